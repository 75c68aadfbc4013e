"""Staff users of each role for the admin tests (imported by tests/test_admin_*.py)."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from memories import services
from memories.models import Membership
from memories.services import staff
from tests.conftest import SYSTEM

ROLES = tuple(Membership.Role.values)
PASSWORD = "correct horse battery staple"


def make_staff(tenant, role: str, username: str | None = None):
    user = get_user_model().objects.create_user(username=username or f"{role}-{tenant.slug}", password=PASSWORD)
    staff.membership_set(tenant=tenant, actor=SYSTEM, username=user.username, role=role)
    user.refresh_from_db()
    return user


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def write(tenant, key, value, **kwargs):
    return services.memory_write(tenant=tenant, actor=SYSTEM, key=key, value=value, **kwargs).memory


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    # Logging staff in is not what these tests measure; PBKDF2's 1M rounds would dominate them.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def staff_clients(tenant_a):
    """{role: (user, client)} for members of tenant A, one per role."""
    out = {}
    for role in ROLES:
        user = make_staff(tenant_a, role)
        out[role] = (user, logged_in(user))
    return out


@pytest.fixture
def superuser_client(db):
    user = get_user_model().objects.create_superuser(username="root", password=PASSWORD)
    return user, logged_in(user)
