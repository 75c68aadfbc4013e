"""Data keys: made, unwrapped, cached, rotated and destroyed (README "Encryption at rest").

The primitives are in :mod:`zeromem.kernel.crypto`; this module keeps the ``DataKey`` rows
(in the key store database, memories/routers.py) and a per-process cache of unwrapped keys.

* :func:`seal_value` seals a value under the current data key of (tenant, subject), making
  that key on first use (subject "" is the tenant's own key).
* :func:`open_value` opens an envelope; a destroyed or missing key gives an
  :class:`~zeromem.kernel.crypto.ErasedValue`, a master key missing from the settings raises
  :class:`~zeromem.kernel.crypto.MasterKeyError` naming ``ZEROMEM_MASTER_KEYS``.
* :func:`shred` destroys a subject's keys (a completed forget): every copy of what they
  sealed — rows, versions, dumps, backups of the main database — stops opening.
* :func:`rewrap` re-wraps every data key under the first master key (no value touched).

Unwrapped keys stay in a process at most ``ZEROMEM_DATA_KEY_CACHE_SECONDS``: a key destroyed
by another process stops opening here within that bound (this process drops it at once), and
never seals a new value here (:func:`current_key` checks it is still current before sealing).
"""

from __future__ import annotations

import contextvars
import functools
import logging
import threading
import time
from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, IntegrityError, connections, transaction
from django.utils import timezone

from memories.models import DataKey
from zeromem.kernel import crypto
from zeromem.kernel.crypto import SETTING, ErasedValue, MasterKeyError

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_by_id: dict[int, tuple[float, bytes | None, int | None]] = {}  # id: (when, key, its tenant)
_current: dict[tuple[int, str], tuple[float, int, bytes]] = {}
_masters_cache: tuple[tuple[str, ...], str, dict[str, bytes]] | None = None


def masters() -> tuple[str, dict[str, bytes]]:
    """(id of the master key that wraps, {id: key} of all that unwrap)."""
    global _masters_cache
    raw = tuple(getattr(settings, SETTING, []) or [])
    cached = _masters_cache
    if cached is not None and cached[0] == raw:
        return cached[1], cached[2]
    keys = crypto.parse_master_keys(list(raw))
    if not keys:
        raise MasterKeyError(f"{SETTING} is not set: sensitive memories cannot be encrypted or read")
    primary = next(iter(keys))
    _masters_cache = (raw, primary, keys)
    return primary, keys


def _db() -> str:
    return settings.ZEROMEM_KEYSTORE_DATABASE


# Sealing vs shredding. A transaction that seals a value under a subject's key holds this
# lock, shared, until it ends; shred() takes it exclusively, so it waits for every such
# transaction to commit first, and a seal that comes after it waits for the shred's commit and
# then finds the key destroyed (and seals under a new one). Without it a write that checked
# the key just before a forget shredded it committed afterwards: its memory under the destroyed
# key, its version under a new one, after the forget's receipt said completed. Taken on the
# main database (the writer's transaction), wherever the key store is; two ints, this
# namespace and hashtext('<tenant>:<subject>'): a collision only makes a shred wait for an
# unrelated write. PostgreSQL only (SQLite writes one transaction at a time).
_SUBJECT_LOCK_NAMESPACE = 0x5A4B  # "ZK"


def _subject_lock(tenant_id: int, subject: str, *, shared: bool) -> tuple[str, list] | None:
    """The lock statement and its parameters, or None when there is no transaction to hold it
    (or no PostgreSQL)."""
    db = connections[DEFAULT_DB_ALIAS]
    if db.vendor != "postgresql" or not db.in_atomic_block:
        return None
    function = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
    return f"SELECT {function}(%s, hashtext(%s))", [_SUBJECT_LOCK_NAMESPACE, f"{tenant_id}:{subject}"]


def _take(lock: tuple[str, list] | None) -> None:
    if lock is not None:
        with connections[DEFAULT_DB_ALIAS].cursor() as cursor:
            cursor.execute(*lock)


def _ttl() -> float:
    return float(getattr(settings, "ZEROMEM_DATA_KEY_CACHE_SECONDS", 10.0))


def forget_cache() -> None:
    with _lock:
        _by_id.clear()
        _current.clear()


def _unwrap(row: DataKey) -> bytes:
    _, keys = masters()
    master = keys.get(row.master_key_id)
    if master is None:
        raise MasterKeyError(
            f"data key {row.pk} is wrapped under master key {row.master_key_id}, which {SETTING} does not hold"
        )
    return crypto.unwrap(master, bytes(row.wrapped), tenant_id=row.tenant_id, subject=row.subject)


def data_key(data_key_id: int) -> bytes | None:
    """The unwrapped data key, or None when it was destroyed (or never existed here)."""
    return _data_key(data_key_id)[0]


def _data_key(data_key_id: int) -> tuple[bytes | None, int | None]:
    """(the unwrapped data key or None, the tenant it belongs to)."""
    now = time.monotonic()
    hit = _by_id.get(data_key_id)
    if hit is not None and now - hit[0] < _ttl():
        return hit[1], hit[2]
    row = DataKey.objects.filter(pk=data_key_id).first()
    key = None if row is None or row.destroyed_at is not None or not row.wrapped else _unwrap(row)
    tenant = None if row is None else row.tenant_id
    with _lock:
        _by_id[data_key_id] = (now, key, tenant)
    return key, tenant


def preload(data_key_ids) -> None:
    """Fetch the data keys of ``data_key_ids`` not cached here in one query (a page of values
    sealed under many end users' keys: one query, not one per key)."""
    now = time.monotonic()
    ttl = _ttl()
    if ttl <= 0:
        return  # nothing is kept: each open fetches its key
    missing = {i for i in data_key_ids if (hit := _by_id.get(i)) is None or now - hit[0] >= ttl}
    if not missing:
        return
    rows = {row.pk: row for row in DataKey.objects.filter(pk__in=missing)}
    loaded = {}
    for key_id in missing:
        row = rows.get(key_id)
        key = None if row is None or row.destroyed_at is not None or not row.wrapped else _unwrap(row)
        loaded[key_id] = (now, key, None if row is None else row.tenant_id)
    with _lock:
        _by_id.update(loaded)


def _still_current(key_id: int, lock: tuple[str, list] | None = None) -> bool:
    """One primary-key probe of the key store: the key neither retired nor destroyed. Raw SQL
    built once (no queryset to compile on every sensitive write: the ORM's probe made a
    sensitive write 1.33× a plain one, against 0.97× without it; bench_crypto). ``lock``
    (:func:`_subject_lock`) is taken first — in the same message when the key store is the
    main database and values are bound client-side: two statements, each with its own
    snapshot, so the probe sees what a shred it waited for committed."""
    db = connections[_db()]
    probe = _current_probe_sql(db.vendor)
    with db.cursor() as cursor:
        if lock is not None and db.alias == DEFAULT_DB_ALIAS and not _server_side_binding(db):
            cursor.execute(f"{lock[0]}; {probe}", [*lock[1], key_id])
            cursor.nextset()  # past the lock's row, to the probe's
        else:
            _take(lock)
            cursor.execute(probe, [key_id])
        return cursor.fetchone() is not None


def _server_side_binding(db) -> bool:
    return db.settings_dict.get("OPTIONS", {}).get("server_side_binding") is True


@functools.cache
def _current_probe_sql(vendor: str) -> str:
    table = connections[_db()].ops.quote_name(DataKey._meta.db_table)
    # bandit B608 (marked): the model's table; the key id is a parameter.
    return f"SELECT 1 FROM {table} WHERE id = %s AND retired_at IS NULL AND destroyed_at IS NULL"  # nosec B608


def current_key(*, tenant_id: int, subject: str) -> tuple[int, bytes]:
    """(id, key) of the data key that seals new values of (tenant, subject); made if none."""
    now = time.monotonic()
    lock = _subject_lock(tenant_id, subject, shared=True)
    hit = _current.get((tenant_id, subject))
    if hit is not None and now - hit[0] < _ttl():
        # Opening may trust the cache for its few seconds; sealing may not: a forget run by
        # another process (a worker) destroys the key without this process knowing, and a value
        # sealed under it would be acknowledged and never open again. One primary-key probe.
        if _still_current(hit[1], lock):
            return hit[1], hit[2]
        lock = None  # taken with the probe
        with _lock:
            _current.pop((tenant_id, subject), None)
            _by_id.pop(hit[1], None)
    _take(lock)
    current = DataKey.objects.filter(
        tenant_id=tenant_id, subject=subject, retired_at__isnull=True, destroyed_at__isnull=True
    )
    row = current.first()
    if row is None:
        primary, keys = masters()
        key = crypto.new_data_key()
        try:
            with transaction.atomic(using=_db()):
                row = DataKey.objects.create(
                    tenant_id=tenant_id,
                    subject=subject,
                    master_key_id=primary,
                    wrapped=crypto.wrap(keys[primary], key, tenant_id=tenant_id, subject=subject),
                )
        except IntegrityError:  # made concurrently by another process: use that one
            row = current.get()
            key = _unwrap(row)
    else:
        key = _unwrap(row)
    with _lock:
        _current[(tenant_id, subject)] = (now, row.pk, key)
        _by_id[row.pk] = (now, key, tenant_id)
    return row.pk, key


def seal_value(value: Any, *, tenant_id: int, subject: str) -> dict:
    if isinstance(value, ErasedValue):
        return value.envelope
    if crypto.is_envelope(value):
        return value
    key_id, key = current_key(tenant_id=tenant_id, subject=subject)
    return crypto.seal(key, key_id, value)


# The data keys whose values this request opened, while one is being watched
# (:func:`opened_watch`): an Idempotency-Key answer holding them is kept sealed under them.
_opened: contextvars.ContextVar[set[int] | None] = contextvars.ContextVar("zeromem_opened", default=None)


def opened_watch() -> None:
    """Start noting the data keys :func:`open_value` opens (in this thread/context)."""
    _opened.set(set())


def opened_take() -> set[int]:
    """The data keys opened since :func:`opened_watch`; stops watching."""
    opened = _opened.get()
    _opened.set(None)
    return opened or set()


def open_value(envelope: dict, *, tenant_id: int) -> Any:
    """The value sealed in ``envelope``, read as a row of ``tenant_id``: an
    :class:`ErasedValue` when its data key is destroyed, missing, or another tenant's (a
    ciphertext copied between tenants' rows never opens; the key's wrapping binds its tenant,
    so editing the key row's tenant makes it fail to unwrap instead)."""
    key_id = int(envelope["k"])
    key, owner = _data_key(key_id)
    if key is not None and owner != tenant_id:
        logger.warning(
            "a sealed value of tenant %s names data key %s of tenant %s: not opened", tenant_id, key_id, owner
        )
        return ErasedValue(dict(envelope))
    opened = _opened.get()
    if opened is not None:
        opened.add(key_id)
    if key is None:
        return ErasedValue(dict(envelope))
    return crypto.open_envelope(key, envelope)


def open_loaded(value: Any, *, tenant_id: int) -> Any:
    """A value as ``SealedJSONField`` loaded it (``values_list`` too), opened as ``tenant_id``'s."""
    if isinstance(value, crypto.Unopened):
        return open_value(value, tenant_id=tenant_id)
    return value


def envelope_key_id(value: Any) -> int | None:
    """The data key id of a value as loaded: an erased value's envelope's; None for plaintext."""
    if isinstance(value, ErasedValue):
        return int(value.envelope["k"])
    return None


def shred(*, tenant_id: int, subject: str) -> int:
    """Destroy every data key of (tenant, subject) — current and retired. Returns how many.
    The rows stay (their ids explain an ``erased`` read) holding nothing that decrypts."""
    if not subject:
        return 0
    _take(_subject_lock(tenant_id, subject, shared=False))  # after every write sealing under them
    with transaction.atomic(using=_db()):
        ids = list(
            DataKey.objects.select_for_update()
            .filter(tenant_id=tenant_id, subject=subject, destroyed_at__isnull=True)
            .values_list("pk", flat=True)
        )
        DataKey.objects.filter(pk__in=ids).update(
            wrapped=b"", master_key_id="", subject="", destroyed_at=timezone.now()
        )
    with _lock:
        for key_id in ids:
            _by_id.pop(key_id, None)
        _current.pop((tenant_id, subject), None)
    return len(ids)


def retire_current(*, tenant_id: int | None = None) -> int:
    """Retire the current data keys (of one tenant, or all): new values get new keys, the old
    ones still open what they sealed until ``crypto_reencrypt`` has moved it."""
    return sum(retire_current_by_tenant(tenant_id=tenant_id).values())


def retire_current_by_tenant(*, tenant_id: int | None = None) -> dict[int, int]:
    """:func:`retire_current`, answering how many keys each tenant had retired."""
    with transaction.atomic(using=_db()):
        qs = DataKey.objects.filter(retired_at__isnull=True, destroyed_at__isnull=True)
        if tenant_id is not None:
            qs = qs.filter(tenant_id=tenant_id)
        rows = list(qs.select_for_update().values_list("pk", "tenant_id"))
        DataKey.objects.filter(pk__in=[pk for pk, _ in rows]).update(retired_at=timezone.now())
    forget_cache()
    counts: dict[int, int] = {}
    for _, tenant in rows:
        counts[tenant] = counts.get(tenant, 0) + 1
    return counts


def rewrap(*, batch: int = 500, progress=None, in_batch=None) -> tuple[int, int]:
    """Re-wrap every live data key not under the first master key. Returns (re-wrapped,
    live keys). One short transaction per ``batch`` keys; idempotent. ``in_batch(rows)`` is
    called inside each batch's transaction with the keys it re-wrapped (the service audits)."""
    primary, keys = masters()
    done = 0
    after = 0
    while True:
        with transaction.atomic(using=_db()):
            rows = list(
                DataKey.objects.select_for_update()
                .filter(pk__gt=after, destroyed_at__isnull=True)
                .exclude(master_key_id=primary)
                .order_by("pk")[:batch]
            )
            for row in rows:
                key = _unwrap(row)
                row.wrapped = crypto.wrap(keys[primary], key, tenant_id=row.tenant_id, subject=row.subject)
                row.master_key_id = primary
                row.save(update_fields=["wrapped", "master_key_id"])
            if rows and in_batch is not None:
                in_batch(rows)
        if not rows:
            break
        done += len(rows)
        after = rows[-1].pk
        if progress is not None:
            progress(done)
    forget_cache()
    return done, DataKey.objects.filter(destroyed_at__isnull=True).count()


def master_keys_problem() -> str | None:
    """Why this process could not open the stored data keys, naming ``ZEROMEM_MASTER_KEYS``;
    None when every live data key's master key is configured (checked at start-up)."""
    from django.db import DatabaseError, connections

    db = settings.ZEROMEM_KEYSTORE_DATABASE
    try:
        stored = DataKey._meta.db_table in connections[db].introspection.table_names()
    except DatabaseError:
        stored = False  # the database's own errors are the connection check's to report
    try:
        _, keys = masters()
    except MasterKeyError as exc:
        if stored and DataKey.objects.filter(destroyed_at__isnull=True).exists():
            return f"{exc}; encrypted data exists"
        return None if not getattr(settings, SETTING, []) and settings.DEVELOPMENT else str(exc)
    if not stored:  # not migrated yet (serve never migrates): no data key to open
        return None
    missing = sorted(
        set(
            DataKey.objects.filter(destroyed_at__isnull=True)
            .exclude(master_key_id__in=list(keys))
            .values_list("master_key_id", flat=True)
        )
    )
    if missing:
        return (
            f"{SETTING} lacks master key(s) {', '.join(missing)} that wrap stored data keys: "
            "a wrong or retired key (keep the old key listed until `manage.py crypto_rewrap` has run)"
        )
    return None
