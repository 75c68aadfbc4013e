"""Deployment checks of ZeroMem's own settings, run by ``manage.py check --deploy`` next to
Django's (registered by ``memories.apps``)."""

from django.conf import settings
from django.core.checks import Tags, Warning, register


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
