"""The tenant: the isolation boundary every row and every query carries.

The model lives in the ``memories`` app; code that must not import that app (the audit
log) reaches it the way Django code reaches the user model, by its label in settings
(``ZEROMEM_TENANT_MODEL``), as :func:`get_user_model` does for ``AUTH_USER_MODEL``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from django.apps import apps
from django.conf import settings

if TYPE_CHECKING:
    from django.db.models import Model


class Tenant(Protocol):
    """What the kernel's users may rely on of a tenant row, for type hints."""

    pk: int
    slug: str
    audit_retention_days: int | None


def get_tenant_model() -> type[Model]:
    return apps.get_model(settings.ZEROMEM_TENANT_MODEL, require_ready=False)
