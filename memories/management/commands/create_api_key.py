import json

from django.core.management.base import BaseCommand, CommandError

from memories import services
from memories.models import Tenant
from zeromem.kernel import validation
from zeromem.kernel.actors import Actor
from zeromem.kernel.errors import ServiceError
from zeromem.kernel.scopes import ALL_SCOPES, DEFAULT_AGENT_SCOPES


class Command(BaseCommand):
    help = "Create an API key and print it once (only its hash is stored)."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", required=True, help="tenant slug")
        parser.add_argument("--name", required=True)
        parser.add_argument(
            "--scopes",
            default=",".join(DEFAULT_AGENT_SCOPES),
            help=f"comma-separated, from: {', '.join(ALL_SCOPES)} (default: the memory scopes)",
        )
        parser.add_argument(
            "--allow",
            action="append",
            default=[],
            metavar="PREFIX",
            help="allowed key prefix (e.g. user:u1:), matched on whole segments; repeatable",
        )
        parser.add_argument("--expires-in-days", type=int, default=None)
        parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")

    def handle(self, *args, **o):
        tenant = Tenant.objects.filter(slug=o["tenant"]).first()
        if tenant is None:
            raise CommandError(f"no tenant '{o['tenant']}'")
        scopes = [s.strip() for s in o["scopes"].split(",") if s.strip()]
        try:
            key, raw = services.api_key_create(
                tenant=tenant,
                actor=Actor.system(job="create_api_key"),
                name=o["name"],
                scopes=scopes,
                allowed_prefixes=o["allow"],
                expires_in_days=o["expires_in_days"],
            )
        except ServiceError as exc:
            raise CommandError(f"{exc.field}: {exc.message}") from None
        if o["json"]:
            self.stdout.write(
                json.dumps(
                    {
                        "key": raw,
                        "id": key.pk,
                        "prefix": key.display_prefix,
                        "tenant": tenant.slug,
                        "scopes": key.scopes,
                        "allowed_prefixes": key.allowed_prefixes,
                        "expires_at": key.expires_at.isoformat() if key.expires_at else None,
                    }
                )
            )
            return
        self.stdout.write(f"API key for tenant {tenant.slug} ({', '.join(key.scopes)}):")
        for entry in key.allowed_prefixes:
            self.stdout.write(f"  allowlist: {validation.allowlist_entry_meaning(entry)}")
        self.stdout.write(raw)
        self.stdout.write("Store it now: it is not shown again.")
