"""Shared by the audit commands: which chains a ``--tenant`` option names."""

from django.core.management.base import CommandError

from zeromem.kernel.tenancy import Tenant, get_tenant_model

NO_TENANT = "-"  # the chain of failed authentications that matched no tenant


def chains(slug: str | None) -> list[tuple[str, Tenant | None]]:
    """[(label, tenant or None)] for one tenant, or every tenant plus the no-tenant chain."""
    if slug == NO_TENANT:
        return [("(no tenant)", None)]
    if slug:
        tenant = get_tenant_model().objects.filter(slug=slug).first()
        if tenant is None:
            raise CommandError(f"no tenant '{slug}'")
        return [(tenant.slug, tenant)]
    return [(t.slug, t) for t in get_tenant_model().objects.order_by("slug")] + [("(no tenant)", None)]
