"""The service layer. Every surface — tool calls, REST, admin, portal, jobs — calls these
functions; each validates, checks the actor's permissions and writes its audit event in
the same transaction as the change.

Modules: ``memories`` (write, read, update, delete, restore, list, search, recall,
history), ``tenants`` (tenants and API keys).
"""

from memories.services.memories import (
    _UNSET,
    ListResult,
    MemoryResult,
    memory_delete,
    memory_history,
    memory_list,
    memory_read,
    memory_recall,
    memory_restore,
    memory_search,
    memory_update,
    memory_write,
)
from memories.services.tenants import api_key_create, api_key_revoke, tenant_create

__all__ = [
    "_UNSET",
    "ListResult",
    "MemoryResult",
    "api_key_create",
    "api_key_revoke",
    "memory_delete",
    "memory_history",
    "memory_list",
    "memory_read",
    "memory_recall",
    "memory_restore",
    "memory_search",
    "memory_update",
    "memory_write",
    "tenant_create",
]
