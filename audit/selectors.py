"""Reading the audit log: the filters compliance reviewers use, shared by the REST list,
the exports and the admin. No permission checks and no audit here; services wrap these."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta

from django.db.models import Max, Q, QuerySet
from django.utils.dateparse import parse_datetime

from audit.models import AuditEvent, AuditSeal
from zeromem.kernel import opaque, validation
from zeromem.kernel.errors import InvalidInput
from zeromem.kernel.keyprefix import EXACT, startswith_q

TEXT_MAX_LEN = 512
# A page of the review list reads at most this many of the tenant's events (newest first
# from its cursor), whatever its filters: see :func:`list_window_floor`.
LIST_SCAN_MAX = 10_000
# A query of an export reads at most this many (a window, as the list's): an export reads on
# window after window, so a larger one costs fewer queries (a rare filter over 1.5M events:
# 10k windows 2.5-2.7 s in 480 queries, 50k 1.7 s in 120, longest query 40 ms).
EXPORT_SCAN_MAX = 50_000
# Filters that a reading of the log records in the event's own redactable fields (target,
# subject, actor_filter), never in its detail: they may name a subject to be forgotten.
COLUMN_FILTERS = ("key_prefix", "subject", "actor")


@dataclass(frozen=True)
class AuditFilters:
    since: datetime | None = None  # occurred_at >= since
    until: datetime | None = None  # occurred_at < until
    # An actor's id or label: a key's zm_ prefix, a username, a subject; an id qualified by its
    # kind (``api_key:7``, ``staff:7``: ids of different kinds overlap, see actor_parts).
    actor: str | None = None
    action: str | None = None  # exact ("memory.read"), or a family when it ends with "." ("memory.")
    key_prefix: str | None = None  # the target key starts with this
    subject: str | None = None
    outcome: str | None = None
    actor_kind: str | None = None

    def as_detail(self) -> dict:
        """What an audit event about a read of the log records of its filters. The key prefix,
        subject and actor go in the event's own target/subject/actor_filter fields (so a
        forget request redacts them there), not here."""
        out = {}
        for name, value in asdict(self).items():
            if value is None or name in COLUMN_FILTERS:
                continue
            out[name] = value.isoformat() if isinstance(value, datetime) else value
        return out


def _datetime(raw, field: str) -> datetime | None:
    if raw is None:
        return None
    try:
        parsed = parse_datetime(raw) if validation.ascii_text(raw) else None
        if parsed is not None:
            # In UTC: the database takes any instant, not every offset (+16:03 is valid ISO).
            return parsed.astimezone(UTC) if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    except (ValueError, OverflowError):
        pass
    raise InvalidInput("must be an ISO 8601 date-time, e.g. 2026-01-31T00:00:00Z", field=field)


def _text(raw, field: str) -> str | None:
    if raw in (None, ""):
        return None
    if not isinstance(raw, str) or len(raw) > TEXT_MAX_LEN or any(ord(c) < 32 for c in raw):
        raise InvalidInput(f"must be text of at most {TEXT_MAX_LEN} characters", field=field)
    return raw


def _key_prefix(raw) -> str | None:
    # Free text (a target is not always a key), but never the exact-key marker, which no key
    # or prefix holds: the filters below would read "user:u1$" as "exactly user:u1".
    prefix = _text(raw, "key_prefix")
    if prefix and EXACT in prefix:
        raise InvalidInput(f"must not contain '{EXACT}' (no key holds it)", field="key_prefix")
    return prefix


def actor_parts(actor: str) -> tuple[str | None, str]:
    """(kind, id or label) of an ``actor`` filter: ``api_key:7`` is (``api_key``, ``7``) — the
    kind is one of ``AuditEvent.ActorKind``'s values —, anything else (kind None, itself)."""
    kind, sep, rest = actor.partition(":")
    if sep and kind in AuditEvent.ActorKind.values:
        return kind, rest
    return None, actor


def _actor(raw, actor_kind: str | None) -> str | None:
    """The ``actor`` filter. A bare number is refused unless ``actor_kind`` says whose: API
    keys and staff users are both numbered from 1, so ``actor=7`` matched key 7 and user 7
    alike (and an end user whose subject is ``7``). Qualified (``api_key:7``), its kind must
    agree with ``actor_kind`` when both are given."""
    actor = _text(raw, "actor")
    if actor is None:
        return None
    kind, ident = actor_parts(actor)
    if kind is not None:
        if not ident:
            raise InvalidInput(f"must name an actor after '{kind}:' (e.g. {kind}:7)", field="actor")
        if actor_kind is not None and actor_kind != kind:
            raise InvalidInput(f"must agree with the actor's kind ({kind})", field="actor_kind", code="conflict")
    elif actor_kind is None and actor.isascii() and actor.isdigit():
        raise InvalidInput(
            f"is ambiguous: an API key and a staff user may both have id {actor[:20]}; "
            f"write api_key:{actor[:20]} or staff:{actor[:20]}, or give actor_kind",
            field="actor",
            code="ambiguous",
        )
    return actor


def _choice(raw, field: str, choices) -> str | None:
    if raw is None:
        return None
    if raw not in choices:
        raise InvalidInput(f"must be one of {', '.join(choices)}", field=field)
    return raw


def audit_filters(raw: Mapping) -> AuditFilters:
    """Parse filters from query parameters (or a form); bad input names its field."""
    actor_kind = _choice(raw.get("actor_kind"), "actor_kind", AuditEvent.ActorKind.values)
    filters = AuditFilters(
        since=_datetime(raw.get("since"), "since"),
        until=_datetime(raw.get("until"), "until"),
        actor=_actor(raw.get("actor"), actor_kind),
        action=_text(raw.get("action"), "action"),
        key_prefix=_key_prefix(raw.get("key_prefix")),
        subject=_text(raw.get("subject"), "subject"),
        outcome=_choice(raw.get("outcome"), "outcome", AuditEvent.Outcome.values),
        actor_kind=actor_kind,
    )
    if filters.since and filters.until and filters.since >= filters.until:
        raise InvalidInput("must be later than since", field="until")
    return filters


def audit_events(*, tenant, filters: AuditFilters, prefixes: list[str] | None = None) -> QuerySet[AuditEvent]:
    """The tenant's events matching ``filters``, newest first. ``prefixes`` (an API key's
    allowlist) restricts them to targets under those prefixes.

    Indexes: (tenant, occurred_at) for time ranges, (tenant, target) for key prefixes,
    (tenant, actor_kind, actor_id) and (tenant, subject) for the rest."""
    qs = audit_events_matching(AuditEvent.objects.for_tenant(tenant), filters)
    if prefixes is not None:
        if not prefixes:
            return qs.none()
        allowed = Q(pk__in=[])
        for p in prefixes:
            allowed |= startswith_q("target", p)
        qs = qs.filter(allowed)
    return qs.order_by("-id")


def audit_events_matching(qs: QuerySet[AuditEvent], filters: AuditFilters) -> QuerySet[AuditEvent]:
    """``qs`` narrowed by ``filters`` (each set field is one condition). The admin's list
    filters apply their single field through this too, so both read the log alike."""
    f = filters
    if f.since:
        qs = qs.filter(occurred_at__gte=f.since)
    if f.until:
        qs = qs.filter(occurred_at__lt=f.until)
    if f.actor:
        # API keys' and staff users' ids are shown as tokens (zeromem/kernel/opaque.py): the
        # filter takes them, qualified (api_key:<token>) or not, as it takes the stored ids.
        kind, ident = actor_parts(f.actor)
        token = opaque.stored_actor(ident)
        if token is not None:  # the token the review showed: it says whose
            qs = qs.filter(actor_kind=token[0], actor_id=token[1]) if kind in (None, token[0]) else qs.none()
        elif kind is not None:  # api_key:7 — that kind's 7 (or its label)
            qs = qs.filter(Q(actor_id=ident) | Q(actor_label=ident), actor_kind=kind)
        else:
            qs = qs.filter(Q(actor_id=f.actor) | Q(actor_label=f.actor))
    if f.actor_kind:
        qs = qs.filter(actor_kind=f.actor_kind)
    if f.action:
        qs = qs.filter(action__startswith=f.action) if f.action.endswith(".") else qs.filter(action=f.action)
    if f.key_prefix:
        qs = qs.filter(startswith_q("target", f.key_prefix))
    if f.subject:
        qs = qs.filter(subject=f.subject)
    if f.outcome:
        qs = qs.filter(outcome=f.outcome)
    return qs


# audit.services.audit_record reads an event's occurred_at from its server's clock and
# INSERTs it at once, drawing its id then: ids grow with the time of the INSERT. So while the
# servers' clocks agree within this margin (NTP keeps them within milliseconds), an event of
# occurred_at >= t + margin has a larger id than every event of occurred_at < t, whatever the
# order of their occurred_at values. Generous: it only costs the windows of a day's events.
ID_CLOCK_MARGIN = timedelta(days=1)


def list_id_bounds(*, tenant, filters: AuditFilters) -> tuple[int | None, int | None]:
    """(below, above): every event matching the time filters has ``above < id < below``
    (None: no bound), so a page of the review list starts its window at ``until`` and stops at
    ``since`` instead of reading windows of events outside the range. Two reads of the
    (tenant, occurred_at) index, one row each (an incremental sort orders an instant's ties
    by id): the first event a day past ``until`` (by ``ID_CLOCK_MARGIN``), the last a day
    before ``since``."""
    events = AuditEvent.objects.for_tenant(tenant)
    below = above = None
    # A day past 9999-12-31 (or before 0001-01-01) is outside the calendar, and no event is
    # there: no bound on that side (the sum overflowed, a 500).
    if filters.until and (later_than := _shifted(filters.until, ID_CLOCK_MARGIN)) is not None:
        # Ties broken by id (events of one instant): the tightest bound, the same every time
        # (by the instant alone, PostgreSQL answered whichever row its heap held first).
        later = events.filter(occurred_at__gte=later_than).order_by("occurred_at", "id")
        below = later.values_list("id", flat=True).first()
    if filters.since and (earlier_than := _shifted(filters.since, -ID_CLOCK_MARGIN)) is not None:
        earlier = events.filter(occurred_at__lt=earlier_than).order_by("-occurred_at", "-id")
        above = earlier.values_list("id", flat=True).first()
    return below, above


def _shifted(moment: datetime, delta: timedelta) -> datetime | None:
    """``moment + delta``, or None past either end of the calendar."""
    try:
        return moment + delta
    except OverflowError:
        return None


def list_window_floor(*, tenant, before: int | None, window: int | None = None) -> int | None:
    """The lowest event id a page of the review list reads below ``before`` (a cursor), or
    None when the page reads on to the tenant's first event.

    A filter no index serves (an outcome, an action, an actor) read the tenant's whole log to
    fill one page. A page reads the tenant's newest ``LIST_SCAN_MAX`` events below its cursor
    instead — the window, ``id >= floor`` — and answers the matches among them, with the
    floor as its cursor when they are fewer than its limit. The window is found on the
    partial index ``audit_unsealed`` (tenant, id) WHERE seal IS NULL, which since range seals
    (audit migration 0011) holds every new event: one index range of ``LIST_SCAN_MAX``
    entries. Events an older seal numbered are not in it; they all lie at or below the last
    such seal's last id, so a window reaching down there is not used (the page reads on, as
    before, over what is left; retention purges them in time).

    Cost: one index-only range read of up to ``LIST_SCAN_MAX`` entries, and when the window is
    full one read of the tenant's older seals (a few rows, by the seals' (tenant, seq) key).
    ``window``: another number of events than ``LIST_SCAN_MAX`` (an export's)."""
    size = window or LIST_SCAN_MAX
    events = AuditEvent.objects.for_tenant(tenant).filter(seal__isnull=True)
    if before is not None:
        events = events.filter(pk__lt=before)
    floor = events.order_by("-id").values_list("id", flat=True)[size - 1 : size].first()
    if floor is None:
        return None
    numbered_top = _numbered_top(tenant)
    return floor if numbered_top is None or floor > numbered_top else None


def _numbered_top(tenant) -> int | None:
    """The highest id an event numbered by an older seal (audit migration 0011) may have, or
    None when the tenant has none left. One read of its older seals."""
    numbered = AuditSeal.objects.filter(tenant=tenant, by_range=False, purged_at__isnull=True)
    return numbered.aggregate(top=Max("last_event_id"))["top"]


def few_by_index(*, tenant, filters: AuditFilters) -> bool:
    """Whether a ``subject`` or ``key_prefix`` filter names at most ``LIST_SCAN_MAX`` events
    of the tenant (whatever the cursor and the other filters, so every page of a walk agrees):
    then a page reads them by that filter's index, (tenant, subject) or (tenant, target), as
    bounded as a window and in full pages, instead of windows over the whole log. Cost: one
    read of at most LIST_SCAN_MAX + 1 entries of that index."""
    if not (filters.subject or filters.key_prefix):
        return False
    named = audit_events_matching(
        AuditEvent.objects.for_tenant(tenant), AuditFilters(subject=filters.subject, key_prefix=filters.key_prefix)
    )
    return not list(named.order_by().values_list("id", flat=True)[LIST_SCAN_MAX : LIST_SCAN_MAX + 1])


@dataclass(frozen=True)
class PageBounds:
    """The ids one page of the review list or an export reads: ``above < id < before`` and,
    with a ``floor``, ``id >= floor`` — the window; a page answering fewer rows than asked
    goes on below ``floor``, or is the last when there is none. ``unsealed``: the events
    read all have no seal number (none numbered by an older seal remains below ``before``),
    so the query says so and reads them on ``audit_unsealed``, (tenant, id), last page too."""

    before: int | None
    above: int | None
    floor: int | None
    unsealed: bool

    def narrow(self, qs: QuerySet[AuditEvent]) -> QuerySet[AuditEvent]:
        if self.before is not None:
            qs = qs.filter(pk__lt=self.before)
        if self.above is not None:
            qs = qs.filter(pk__gt=self.above)
        if self.floor is not None:
            qs = qs.filter(pk__gte=self.floor)
        return qs.filter(seal__isnull=True) if self.unsealed else qs


def list_page_bounds(
    *, tenant, filters: AuditFilters, before: int | None, few: bool, window: int | None = None
) -> PageBounds:
    """The :class:`PageBounds` of a page below the cursor ``before``. ``few``:
    :func:`few_by_index` said the filter's own index names few events: no window, and that
    index read (the query does not say ``seal IS NULL``, which would favour another).
    ``window``: its size, when not ``LIST_SCAN_MAX`` (an export's: ``EXPORT_SCAN_MAX``)."""
    below, above = list_id_bounds(tenant=tenant, filters=filters)
    if below is not None and (before is None or below < before):
        before = below  # nothing newer matches until: the window starts there
    if few:
        return PageBounds(before, above, None, unsealed=False)
    floor = list_window_floor(tenant=tenant, before=before, window=window)
    if floor is not None and above is not None and floor <= above:
        floor = None  # the window reaches past since: this page reads to it, the last
    if floor is not None:
        return PageBounds(before, above, floor, unsealed=True)
    numbered_top = _numbered_top(tenant)
    return PageBounds(before, above, None, unsealed=numbered_top is None or (above or 0) >= numbered_top)
