from django.core.management.base import BaseCommand

from zeromem.schedules import apply_schedules


class Command(BaseCommand):
    help = "Apply the recurring jobs declared in zeromem/schedules.py (idempotent)."

    def handle(self, *args, **options):
        for name, outcome in apply_schedules().items():
            self.stdout.write(f"{outcome:9} {name}")
