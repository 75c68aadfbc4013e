"""Demo tenant, admin user and API key for the embedded quick start (idempotent)."""

import os
import secrets

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from memories import services
from memories.models import Membership, Tenant
from zeromem.kernel.actors import Actor
from zeromem.kernel.scopes import ALL_SCOPES


class Command(BaseCommand):
    help = "Create (or reuse) the demo tenant and admin user, and print a fresh API key."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", default="demo")
        parser.add_argument("--username", default="admin")

    def handle(self, *args, tenant, username, **options):
        actor = Actor.system(job="demo_setup")
        base = f"http://{os.environ.get('HOST', '127.0.0.1')}:{os.environ.get('PORT', '8000')}"
        t = Tenant.objects.filter(slug=tenant).first() or services.tenant_create(
            actor=actor, slug=tenant, name="Demo tenant"
        )
        User = get_user_model()
        password_note = "(unchanged)"
        user = User.objects.filter(username=username).first()
        if user is None:
            password = secrets.token_urlsafe(12)
            user = User.objects.create_superuser(username=username, email="", password=password)
            password_note = password
        Membership.objects.get_or_create(tenant=t, user=user, defaults={"role": Membership.Role.ADMIN})
        _key, raw = services.api_key_create(tenant=t, actor=actor, name="demo agent", scopes=ALL_SCOPES)
        self.stdout.write(
            "\n".join(
                [
                    "",
                    f"  tenant:   {t.slug}",
                    f"  admin:    {username} / {password_note}   → {base}/admin/",
                    f"  API key:  {raw}",
                    f"  API docs: {base}/api/v1/docs",
                    "",
                ]
            )
        )
