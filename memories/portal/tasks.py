"""django-q2 tasks of the portal (see zeromem/schedules.py)."""

from memories.portal.services import portal_links_purge
from zeromem.kernel.tasks import kept, one_at_a_time


@kept
@one_at_a_time
def portal_links_purge_task() -> int:
    return portal_links_purge()
