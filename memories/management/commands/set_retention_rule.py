from django.core.management.base import BaseCommand, CommandError

from memories.models import Tenant
from memories.services import retention
from zeromem.kernel.actors import Actor
from zeromem.kernel.errors import ServiceError


class Command(BaseCommand):
    help = (
        "Set a tenant's retention rule for a key prefix: the default TTL of new memories and/or "
        "how long deleted ones stay in the trash. Both omitted: remove the rule."
    )

    def add_arguments(self, parser):
        parser.add_argument("--tenant", required=True, help="tenant slug")
        parser.add_argument("--prefix", required=True, help="key prefix, e.g. session:")
        parser.add_argument("--default-ttl-seconds", type=int, default=None)
        parser.add_argument("--trash-retention-days", type=int, default=None)

    def handle(self, *args, **o):
        tenant = Tenant.objects.filter(slug=o["tenant"]).first()
        if tenant is None:
            raise CommandError(f"no tenant '{o['tenant']}'")
        try:
            rule = retention.retention_rule_set(
                tenant=tenant,
                actor=Actor.system(job="set_retention_rule"),
                prefix=o["prefix"],
                default_ttl_seconds=o["default_ttl_seconds"],
                trash_retention_days=o["trash_retention_days"],
            )
        except ServiceError as exc:
            raise CommandError(f"{exc.field}: {exc.message}") from None
        if rule is None:
            self.stdout.write(f"removed the rule for {o['prefix']!r} in {tenant.slug}")
        else:
            self.stdout.write(
                f"{tenant.slug}: {rule.prefix!r} default TTL {rule.default_ttl_seconds or '-'} s, "
                f"trash retention {rule.trash_retention_days or '-'} days"
            )
