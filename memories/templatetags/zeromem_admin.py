"""Template helpers of the admin console."""

from django import template

from memories.models import Tenant
from zeromem.kit.admin import staff_roles

register = template.Library()


@register.simple_tag(takes_context=True)
def zeromem_tenants(context):
    """The request user's tenants with their role, for the admin index's dashboard links."""
    roles = staff_roles(context["request"])
    return [(tenant, roles[tenant.pk]) for tenant in Tenant.objects.filter(pk__in=roles).order_by("slug")[:100]]
