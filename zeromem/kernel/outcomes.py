"""Who acted and how it ended, as the audit log names them (``AuditEvent.actor_kind`` and
``AuditEvent.outcome`` take these values)."""

from __future__ import annotations

from django.db import models


class ActorKind(models.TextChoices):
    API_KEY = "api_key"
    STAFF = "staff"
    END_USER = "end_user"
    SYSTEM = "system"
    ANONYMOUS = "anonymous"


class Outcome(models.TextChoices):
    OK = "ok"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    DENIED = "denied"
    INVALID = "invalid"
    UNAUTHENTICATED = "unauthenticated"
    PRECONDITION_FAILED = "precondition_failed"
    UNAVAILABLE = "unavailable"  # could not be done now (a search past its time limit)
