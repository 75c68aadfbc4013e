"""The admin console: tenants (with their dashboards), memories, forget requests, API keys,
memberships and portal links, one module each. Scoping and roles come from
:class:`zeromem.kit.admin.TenantScopedAdmin`; every change goes through the service layer,
which writes the version and the audit event. Importing a module registers its admin.
"""

from django.contrib import admin

from memories.admin import api_keys, forget_requests, memberships, memories, portal_links, tenants
from memories.admin.tenants import audited_index
from zeromem.kit.admin import methods_limited, refusing_nul_parameters
from zeromem.kit.login_throttle import throttled

__all__ = ["api_keys", "forget_requests", "memberships", "memories", "portal_links", "tenants"]

admin.site.site_header = "ZeroMem admin"
admin.site.site_title = "ZeroMem admin"
admin.site.index_title = "Tenants, memories and the audit log"
admin.site.index_template = "zeromem_admin/index.html"
# The index lists the user's tenants (their dashboards): audited as the tenant list's pages are.
admin.site.index = audited_index(admin.site.index)
# Failed sign-ins are throttled per client address and username (zeromem/kit/login_throttle.py).
admin.site.login = throttled(admin.site.login)
# Every admin page answers GET, HEAD and POST only (a 405 otherwise): Django's admin renders a
# change form for any other method, which the pages' read audits (on GET and HEAD) missed.
admin.site.admin_view = methods_limited(admin.site.admin_view)
# The autocomplete's search term goes to PostgreSQL, whose text cannot hold a NUL: a 400.
admin.site.autocomplete_view = refusing_nul_parameters(admin.site.autocomplete_view)
