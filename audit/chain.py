"""The hashes behind the audit log's tamper evidence. Pure functions, no database.

All hashes are HMAC-SHA256 under ``settings.ZEROMEM_AUDIT_KEY``, a secret kept outside the
database: someone who can write to the database but does not hold the key cannot produce
a digest, a chain value or a seal that verifies.

* **Commitment** of an identifying field (target, subject, actor id and label, client IP,
  the actor a reading of the log filtered by):
  ``HMAC(key, "c" | uid | field | value)``. The event's digest covers commitments rather
  than the raw text, so redaction can replace the text with a pseudonym and keep the
  commitment: the digest still verifies, and the commitment reveals nothing without the key.
* **Digest** of an event: HMAC over its plain fields and the commitments, in a fixed order.
* **Chain value** of an event: ``HMAC(key, previous chain value | event id | digest)``,
  starting from the previous seal's hash, so removing, inserting or reordering an event
  breaks the value of the event after it.
* **Seal hash**: HMAC over the previous seal's hash, the seal's numbers and its last chain
  value; the first seal of a tenant starts from a per-tenant genesis value, so a chain
  cannot be transplanted into another tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import re
from datetime import UTC, datetime
from functools import cache, lru_cache

from django.conf import settings

# Fields that may be redacted: they enter the digest through their commitment.
COMMITTED_FIELDS = ("target", "subject", "actor_id", "actor_label", "client_ip", "actor_filter")
# Committed fields added after events were written (audit migration 0014): empty, they are
# left out of the digest, so the digests of the events written before stay as they were.
LATER_FIELDS = frozenset({"actor_filter"})
# Fields that enter the digest as they are (never personal data, never redacted).
PLAIN_FIELDS = (
    "uid",
    "tenant_id",
    "occurred_at",
    "actor_kind",
    "surface",
    "action",
    "outcome",
    "request_id",
    "count",
    "version",
    "detail",
)
DIGEST_FIELDS = PLAIN_FIELDS + COMMITTED_FIELDS


@cache
def _keyed(material: str):
    # Keying an HMAC costs two hash blocks; copying a keyed one costs none (verification
    # computes seven MACs per event).
    return hmac.new(material.encode(), digestmod=hashlib.sha256)


@cache
def _keyed_core(material: str):
    # The keyed HMAC's own OpenSSL object where the interpreter has one (CPython with
    # OpenSSL): copying it skips the Python wrapper of hmac.HMAC (its copy builds a new
    # instance attribute by attribute). Same key, same algorithm: the same MACs.
    keyed = _keyed(material)
    core = getattr(keyed, "_hmac", None)
    return core if core is not None and hasattr(core, "copy") else keyed


def _mac(*parts: object, base=None) -> str:
    h = (base or _keyed(settings.ZEROMEM_AUDIT_KEY)).copy()
    h.update("\x1f".join("" if p is None else str(p) for p in parts).encode())
    return h.hexdigest()


def _mac_text(base, text: str) -> str:
    # ``_mac`` of parts already joined (every part a str): the message, byte for byte.
    h = base.copy()
    h.update(text.encode())
    return h.hexdigest()


_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode


@lru_cache(maxsize=1024)
def _ipv6_text(value: str) -> str:
    # A client address repeats from request to request: parsed once.
    return ipaddress.ip_address(value).compressed


def _occurred_text(value: datetime) -> str:
    assert isinstance(value, datetime) and value.tzinfo is not None, "occurred_at must be aware"
    v = value if value.tzinfo is UTC else value.astimezone(UTC)
    if v.year < 1000:  # strftime's %Y does not pad it: its own spelling
        return v.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    # strftime("%Y-%m-%dT%H:%M:%S.%fZ") without parsing that format on every event; a %-format
    # (half an f-string's cost here).
    return "%04d-%02d-%02dT%02d:%02d:%02d.%06dZ" % (  # noqa: UP031
        v.year,
        v.month,
        v.day,
        v.hour,
        v.minute,
        v.second,
        v.microsecond,
    )


def canonical(name: str, value) -> str:
    """One field as text, the same before the INSERT and after reading the row back."""
    if value is None:
        return "\x00"
    if name == "occurred_at":
        return _occurred_text(value)
    if name == "client_ip":
        # IPv4 text is canonical already; IPv6 has several spellings of one address.
        text = str(value)
        return _ipv6_text(text) if ":" in text else text
    if name == "detail":
        # json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False): the
        # encoder those arguments build, built once.
        return "{}" if type(value) is dict and not value else _CANONICAL_JSON(value)
    return value if type(value) is str else str(value)


def commitment(uid, name: str, value, base=None) -> str:
    return _mac("c", uid, name, canonical(name, value), base=base)


def digest(fields: dict, commitments: dict | None = None) -> str:
    """Digest of an event given as {field: value}. ``commitments`` supplies the stored
    commitment of fields that were redacted (their text is a pseudonym now).

    The MACs are those of :func:`_mac` over the same parts (every part here is text), with
    each message joined once rather than part by part: an event is recorded on every
    request, and this was about a tenth of an audited read's CPU."""
    base = _keyed_core(settings.ZEROMEM_AUDIT_KEY)
    uid = str(fields["uid"])
    parts = ["d"]
    for name in PLAIN_FIELDS:
        parts.append(canonical(name, fields[name]))
    for name in COMMITTED_FIELDS:
        kept = commitments.get(name) if commitments else None
        if not kept and name in LATER_FIELDS and not fields.get(name):
            continue
        if kept:
            parts.append(kept if type(kept) is str else str(kept))
            continue
        parts.append(_mac_text(base, f"c\x1f{uid}\x1f{name}\x1f{canonical(name, fields[name])}"))
    return _mac_text(base, "\x1f".join(parts))


def link(previous: str, event_id: int, event_digest: str) -> str:
    return _mac("l", previous, event_id, event_digest)


def genesis(tenant_id: int | None) -> str:
    return _mac("g", tenant_id)


def seal_hash(
    *, prev_hash: str, tenant_id: int | None, seq: int, first: int, last: int, count: int, total: int, last_chain: str
) -> str:
    return _mac("s", prev_hash, tenant_id, seq, first, last, count, total, last_chain)


def checkpoint_mac(*, tenant_id: int | None, seal_seq: int, head_hash: str, total: int, reason: str, purged) -> str:
    return _mac("k", tenant_id, seal_seq, head_hash, total, reason, purged)


def pseudonym(tenant_id: int | None, value: str) -> str:
    """What a redacted field holds: stable per tenant and value (events of one forgotten
    user still group together), meaningless without the key."""
    return "redacted:" + _mac("p", tenant_id, value)[:16]


_PSEUDONYM = re.compile(r"redacted:[0-9a-f]{16}")
# Where an event's ``redacted`` map keeps the bindings of its pseudonyms (beside {field: commitment}).
BOUND = "bound"


def binding(uid, name: str, kept_commitment: str, text) -> str:
    """Ties what a redacted field holds (its pseudonym, or nothing for the client address) to
    the field's kept commitment. The digest covers the commitment, not the pseudonym: without
    this, someone who can write to the database could put another well-formed pseudonym in a
    redacted field (another forgotten user's, moving an event from one to the other) and the
    event would still verify."""
    return _mac("b", uid, name, kept_commitment, "" if text is None else text)


def holds_redaction(name: str, value) -> bool:
    """Whether a redacted field holds what redaction leaves there: a pseudonym, or nothing
    for the client address. Its digest comes from the kept commitment, not from this text,
    so verification checks the text's form here: a redacted field written back with a name
    (a key, a user) in the ``redact`` mode does not pass."""
    if name == "client_ip":
        return value is None
    return isinstance(value, str) and _PSEUDONYM.fullmatch(value) is not None
