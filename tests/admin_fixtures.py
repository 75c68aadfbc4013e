"""Fixtures of the admin tests (a plugin: ``pytest_plugins = ["tests.admin_fixtures"]``)."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from tests.factories import PASSWORD, ROLES, logged_in, make_staff


@pytest.fixture
def fast_password_hashing(settings):
    # Logging staff in is not what these tests measure; PBKDF2's 1M rounds would dominate them.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def staff_clients(tenant_a, fast_password_hashing):
    """{role: (user, client)} for members of tenant A, one per role."""
    out = {}
    for role in ROLES:
        user = make_staff(tenant_a, role)
        out[role] = (user, logged_in(user))
    return out


@pytest.fixture
def superuser_client(db, fast_password_hashing):
    user = get_user_model().objects.create_superuser(username="root", password=PASSWORD)
    return user, logged_in(user)
