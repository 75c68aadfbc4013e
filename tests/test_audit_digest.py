"""An event's digest, byte for byte: the digests of the events already written must keep
verifying whatever is done to make computing them cheaper. Pure functions, no database.

``_reference_digest`` is the digest as it was first written (each part through ``str`` and
joined, ``json.dumps``, ``strftime``, ``ipaddress`` on every call, a fresh ``hmac`` copy per
MAC); :func:`audit.chain.digest` must agree with it on every kind of field value, and with a
digest pinned under a fixed key."""

import hashlib
import hmac
import ipaddress
import json
import random
import uuid
from datetime import UTC, datetime, timedelta, timezone

import pytest

from audit import chain

KEY = "test-audit-key-for-pinned-digests"


def _reference_mac(*parts) -> str:
    h = hmac.new(KEY.encode(), digestmod=hashlib.sha256)
    h.update("\x1f".join("" if p is None else str(p) for p in parts).encode())
    return h.hexdigest()


def _reference_canonical(name, value) -> str:
    if value is None:
        return "\x00"
    if name == "occurred_at":
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    if name == "client_ip":
        return ipaddress.ip_address(value).compressed if ":" in str(value) else str(value)
    if name == "detail":
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return str(value)


def _reference_digest(fields, commitments=None) -> str:
    uid = str(fields["uid"])
    parts = ["d"] + [_reference_canonical(n, fields[n]) for n in chain.PLAIN_FIELDS]
    for name in chain.COMMITTED_FIELDS:
        kept = commitments.get(name) if commitments else None
        if not kept and name in chain.LATER_FIELDS and not fields.get(name):
            continue
        parts.append(kept or _reference_mac("c", uid, name, _reference_canonical(name, fields[name])))
    return _reference_mac(*parts)


@pytest.fixture(autouse=True)
def _key(settings):
    settings.ZEROMEM_AUDIT_KEY = KEY


def _event(**changes):
    fields = {
        "uid": uuid.UUID("6f1c2b7e-5d1a-4c3e-9b1f-0a2b3c4d5e6f"),
        "tenant_id": 7,
        "occurred_at": datetime(2026, 12, 6, 0, 42, 12, 345678, tzinfo=UTC),
        "actor_kind": "api_key",
        "actor_id": "12",
        "actor_label": "zm_b001c2674beb",
        "surface": "tool",
        "action": "memory.read",
        "target": "user:u10086:pref_lang",
        "subject": "u10086",
        "outcome": "ok",
        "request_id": "8d0a6c1e0f9b4c7a",
        "client_ip": "203.0.113.7",
        "count": None,
        "version": 3,
        "detail": {},
        "actor_filter": "",
    }
    return {**fields, **changes}


def test_digests_are_the_ones_pinned_under_a_fixed_key():
    # Computed by the first implementation: one byte changed in any message fails here.
    assert chain.digest(_event()) == "404dc326769be6a63114fb9cf0b73d8b60d89edf3f1bfb1a476e3484e94d2c2b"
    other = _event(client_ip="2001:0db8::0001", detail={"b": [1, 2.5], "a": "日本"}, actor_filter="zm_x", count=4)
    assert chain.digest(other) == "3aecf4cf3b914d4080ac6725c06d3d94173a574e5c3cc0df2c1e0448e8e5aea9"


OCCURRED = [
    datetime(2026, 12, 6, 0, 42, 12, 345678, tzinfo=UTC),
    datetime(2026, 12, 6, 0, 42, 12, 0, tzinfo=UTC),
    datetime(2026, 12, 6, 8, 42, 12, 5, tzinfo=timezone(timedelta(hours=8))),  # not UTC: converted
    datetime(2026, 3, 29, 1, 30, tzinfo=timezone(timedelta(hours=-5, minutes=-30))),
    datetime(999, 1, 2, 3, 4, 5, 6, tzinfo=UTC),  # a year strftime does not pad
    datetime(1000, 1, 1, tzinfo=UTC),
    datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
]
CLIENT_IPS = [
    None,
    "203.0.113.7",
    "2001:db8::1",
    "2001:0db8:0000:0000:0000:0000:0000:0001",  # the long spelling of the same address
    "::ffff:192.0.2.1",
    "fe80::1%eth0",
    ipaddress.ip_address("2001:db8:0:0:1::1"),
]
DETAILS = [
    {},
    {"ttl_refreshed": 1},
    {"code": "invalid", "field": None},
    {"b": [1, 2.5, True, None], "a": {"z": "é", "y": "日本"}},
    {"text": '\ufffd quote " and \\ backslash \n'},
]
ACTOR_FILTERS = ["", "zm_key", "redacted:0123456789abcdef"]


def test_the_digest_matches_the_reference_on_every_kind_of_value():
    rng = random.Random(11)
    cases = [_event(occurred_at=o) for o in OCCURRED]
    cases += [_event(client_ip=ip) for ip in CLIENT_IPS]
    cases += [_event(detail=d) for d in DETAILS]
    cases += [_event(actor_filter=f) for f in ACTOR_FILTERS]
    cases += [
        _event(uid=str(uuid.uuid4()), tenant_id=None, count=5, version=None),
        _event(actor_kind=_actor_kind(), target="", subject="", request_id="", actor_id="", actor_label=""),
        _event(target="ключ:日本:\u2028", subject="é" * 255, outcome="not_found"),
    ]
    for _ in range(200):
        cases.append(
            _event(
                uid=uuid.UUID(int=rng.getrandbits(128)),
                occurred_at=rng.choice(OCCURRED[:4]) + timedelta(microseconds=rng.randrange(10**9)),
                client_ip=rng.choice(CLIENT_IPS),
                detail=rng.choice(DETAILS),
                actor_filter=rng.choice(ACTOR_FILTERS),
                count=rng.choice([None, 0, rng.randrange(10**6)]),
                version=rng.choice([None, rng.randrange(1, 10**6)]),
            )
        )
    for fields in cases:
        assert chain.digest(fields) == _reference_digest(fields), fields


def test_a_redacted_events_digest_uses_its_kept_commitments_as_before():
    written = _event()
    redacted = _event(target="redacted:0123456789abcdef", client_ip=None)
    kept = {
        "target": _reference_mac("c", written["uid"], "target", written["target"]),
        "client_ip": _reference_mac("c", written["uid"], "client_ip", written["client_ip"]),
    }
    # The kept commitments stand for the text the event was written with: the same digest.
    assert chain.digest(redacted, kept) == _reference_digest(written) == chain.digest(written)
    assert chain.digest(redacted, {}) == _reference_digest(redacted, {})


def _actor_kind():
    # A str subclass (a TextChoices member), as actor kinds are passed.
    from zeromem.kernel.outcomes import ActorKind

    return ActorKind.API_KEY
