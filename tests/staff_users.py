"""Staff users of each role for the admin tests: helpers (the fixtures are in tests/admin_fixtures.py)."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.test import Client

from memories import services
from memories.models import Membership
from tests.conftest import SYSTEM

ROLES = tuple(Membership.Role.values)
PASSWORD = "correct horse battery staple"


def make_staff(tenant, role: str, username: str | None = None):
    user = get_user_model().objects.create_user(username=username or f"{role}-{tenant.slug}", password=None)
    services.membership_set(tenant=tenant, actor=SYSTEM, username=user.username, role=role)
    user.refresh_from_db()
    return user


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def write(tenant, key, value, **kwargs):
    return services.memory_write(tenant=tenant, actor=SYSTEM, key=key, value=value, **kwargs).memory
