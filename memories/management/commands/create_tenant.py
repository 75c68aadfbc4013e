from django.core.management.base import BaseCommand, CommandError

from memories import services
from zeromem.kernel.actors import Actor
from zeromem.kernel.errors import ServiceError


class Command(BaseCommand):
    help = "Create a tenant (the isolation boundary of one customer or deployment)."

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--name", default=None)

    def handle(self, *args, slug, name, **options):
        try:
            tenant = services.tenant_create(actor=Actor.system(job="create_tenant"), slug=slug, name=name)
        except ServiceError as exc:
            raise CommandError(f"{exc.field}: {exc.message}") from None
        self.stdout.write(f"created tenant {tenant.slug} (id {tenant.pk})")
