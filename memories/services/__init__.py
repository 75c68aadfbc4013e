"""The service layer. Every surface — tool calls, REST, admin, portal, jobs — calls these
functions; each validates, checks the actor's permissions and writes its audit event in
the same transaction as the change.

Modules: ``memories`` (write, read, update, delete, restore, list, search, recall,
history; and by id in any state, as the admin opens them: view, versions, restore a
version), ``tenants`` (tenants, their settings, API keys), ``memberships`` (who may use the
admin for a tenant, in which role), ``browsing`` (staff searches, key-tree walks and
dashboards, audited), ``summaries`` (summarize a namespace, the idle-sessions
schedule), ``jobs`` (background jobs as callers see them; whose turn it is at the workers),
``turns`` (a queue delivery runs that turn), ``retention`` (default TTLs by prefix, the purge
of expired memories and old trash), ``forget`` (forget requests: accept, carry out, resume).
"""

from memories.services.browsing import dashboard_view, memories_browse, memories_listed
from memories.services.forget import (
    forget_queue_viewed,
    forget_request_create,
    forget_request_execute,
    forget_request_get,
    forget_request_list,
    forget_request_view,
    forget_requests_resume,
)
from memories.services.jobs import job_get
from memories.services.memberships import (
    addable_user,
    membership_remove,
    membership_set,
    membership_view,
    memberships_listed,
)
from memories.services.memories import (
    _UNSET,
    ListResult,
    MemoryResult,
    SearchHit,
    memory_delete,
    memory_history,
    memory_list,
    memory_read,
    memory_recall,
    memory_restore,
    memory_restore_version,
    memory_reveal,
    memory_search,
    memory_update,
    memory_version_view,
    memory_versions_view,
    memory_view,
    memory_write,
)
from memories.services.retention import purge_expired, purge_pending, retention_rule_set
from memories.services.summaries import (
    summarize_idle_sessions,
    summarize_jobs_resume,
    summarize_run,
    summarize_start,
)
from memories.services.tenants import (
    api_key_create,
    api_key_name,
    api_key_revoke,
    api_key_view,
    api_keys_listed,
    tenant_create,
    tenant_settings_update,
    tenant_settings_view,
    tenants_listed,
)

__all__ = [
    "forget_queue_viewed",
    "forget_request_create",
    "forget_request_execute",
    "forget_request_get",
    "forget_request_list",
    "forget_request_view",
    "forget_requests_resume",
    "_UNSET",
    "ListResult",
    "MemoryResult",
    "SearchHit",
    "api_key_create",
    "api_key_name",
    "api_key_revoke",
    "api_key_view",
    "api_keys_listed",
    "memory_delete",
    "memory_history",
    "memory_list",
    "memory_read",
    "memory_recall",
    "memory_restore",
    "memory_restore_version",
    "memory_reveal",
    "memory_search",
    "memory_update",
    "memory_version_view",
    "memory_versions_view",
    "memory_view",
    "memory_write",
    "membership_remove",
    "membership_set",
    "membership_view",
    "memberships_listed",
    "memories_browse",
    "memories_listed",
    "dashboard_view",
    "addable_user",
    "purge_expired",
    "purge_pending",
    "retention_rule_set",
    "job_get",
    "summarize_idle_sessions",
    "summarize_jobs_resume",
    "summarize_run",
    "summarize_start",
    "tenant_create",
    "tenant_settings_update",
    "tenant_settings_view",
    "tenants_listed",
]
