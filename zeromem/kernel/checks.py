"""Deployment checks of ZeroMem's own settings, run by ``manage.py check --deploy`` next to
Django's (registered by ``memories.apps``)."""

import os

from django.conf import settings
from django.core.checks import Error, Tags, Warning, register


@register(Tags.security, deploy=True)
def audit_key_set_explicitly(app_configs, **kwargs):
    if getattr(settings, "ZEROMEM_AUDIT_KEY_EXPLICIT", True):
        return []
    return [
        Warning(
            "ZEROMEM_AUDIT_KEY is not set: the audit log's HMAC key is derived from SECRET_KEY.",
            hint="Set ZEROMEM_AUDIT_KEY to a long random value kept outside the database, and keep it "
            "when SECRET_KEY rotates (a new key cannot verify old events).",
            id="zeromem.W001",
        )
    ]


@register(Tags.security, deploy=True)
def development_mode_with_a_production_database(app_configs, **kwargs):
    engine = settings.DATABASES.get("default", {}).get("ENGINE", "")
    if not getattr(settings, "DEVELOPMENT", False) or engine.endswith("sqlite3"):
        return []
    return [
        Warning(
            f"ZeroMem runs in development mode (DEBUG, a public default SECRET_KEY) on a {engine.rsplit('.', 1)[-1]} "
            "database.",
            hint="Unset ZEROMEM_ENV=development and set SECRET_KEY and ZEROMEM_AUDIT_KEY for this database.",
            id="zeromem.W002",
        )
    ]


def pooler_problem(connection) -> str | None:
    """What is wrong with how this deployment reaches PostgreSQL through a pooler, or None.

    PgBouncer in transaction mode hands a server connection to a client for one transaction
    only; ZeroMem then needs ``ZEROMEM_PGBOUNCER=true`` (settings.py: no server-side cursors, no
    prepared statements). A pooler is detected by the port: the server's own ``port`` setting
    differs from the port this connection was made to. ``ZEROMEM_PGBOUNCER=false`` says there is
    none (a port mapping, say)."""
    if connection.vendor != "postgresql":
        return None
    explicit = os.environ.get("ZEROMEM_PGBOUNCER", "").strip().lower()
    if getattr(settings, "ZEROMEM_PGBOUNCER", False):
        options = connection.settings_dict.get("OPTIONS", {})
        if not connection.settings_dict.get("DISABLE_SERVER_SIDE_CURSORS") or options.get("server_side_binding"):
            return (
                "ZEROMEM_PGBOUNCER is set but server-side cursors or server-side binding are on: "
                "they break under PgBouncer's transaction pooling"
            )
        return None
    if explicit in ("false", "0", "no", "off"):
        return None
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('port')")
        server_port = int(cursor.fetchone()[0])
    client_port = int(connection.settings_dict.get("PORT") or 5432)
    if server_port == client_port:
        return None
    return (
        f"the database answers on port {client_port} but PostgreSQL listens on {server_port}: a pooler "
        "(PgBouncer?) is in between. Set ZEROMEM_PGBOUNCER=true for PgBouncer in transaction mode, "
        "or ZEROMEM_PGBOUNCER=false if nothing pools these connections (a port mapping)"
    )


@register(Tags.database, deploy=True)
def pgbouncer_settings(app_configs, databases=None, **kwargs):
    """``manage.py check --deploy --database default``."""
    from django.db import connections

    errors = []
    for alias in databases or []:
        problem = pooler_problem(connections[alias])
        if problem:
            errors.append(Error(problem, hint='README "Running as a fleet": PgBouncer.', id="zeromem.E001", obj=alias))
    return errors


@register(Tags.database, deploy=True)
def autovacuum_on(app_configs, databases=None, **kwargs):
    """``manage.py check --deploy --database default``: PostgreSQL's autovacuum keeps the planner's
    statistics current; without it a table's statistics stay as they were before its rows came,
    and the planner scans a tenant where an index lookup was meant (a search's hydration of its
    ranked ids took 53 ms instead of 0.1 ms at 50k memories, README "Search")."""
    from django.db import connections

    warnings = []
    for alias in databases or []:
        connection = connections[alias]
        if connection.vendor != "postgresql":
            continue
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('autovacuum')")
            (setting,) = cursor.fetchone()
        if setting != "on":
            warnings.append(
                Warning(
                    "PostgreSQL's autovacuum is off: planner statistics go stale and searches, purges and "
                    "the dashboard can scan whole tenants",
                    hint="Turn autovacuum on (PostgreSQL's default), or run ANALYZE after bulk loads and on a "
                    "schedule.",
                    id="zeromem.W003",
                    obj=alias,
                )
            )
    return warnings


@register(Tags.security)
def master_keys_configured(app_configs, **kwargs):
    """Encryption at rest needs ``ZEROMEM_MASTER_KEYS``: malformed, or missing outside
    development mode, ZeroMem refuses to start (never a silent fallback to plaintext). That the
    keys open the stored data keys is checked by ``memories.keyring.master_keys_check``."""
    from django.core.checks import Error

    from zeromem.kernel.crypto import SETTING, MasterKeyError, parse_master_keys

    raw = getattr(settings, SETTING, [])
    try:
        keys = parse_master_keys(raw)
    except MasterKeyError as exc:
        return [Error(str(exc), id="zeromem.E011")]
    if not keys:
        return [
            Error(
                f"{SETTING} is not set: sensitive memories cannot be encrypted at rest.",
                hint=f"Set {SETTING} to a base64 32-byte key kept outside the database (README "
                "'Encryption at rest'); development mode derives one from SECRET_KEY.",
                id="zeromem.E010",
            )
        ]
    return []
