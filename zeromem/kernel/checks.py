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
