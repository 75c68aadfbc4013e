"""Errors the service layer raises. Every surface maps them the same way.

Most are refusals: the call is wrong or not allowed, changes nothing, and is audited as
``invalid``, ``denied`` or ``precondition_failed``. :class:`NotFound` and :class:`Conflict`
are answers, not refusals: the operation ran and found nothing (or a newer version), is
audited with that outcome, and the tool surface hands it back to the model as a result
(``{"status": "not_found", ...}``) while REST answers 404 or 409.
"""


class ServiceError(Exception):
    http_status = 400
    default_code = "invalid"

    def __init__(self, message: str, *, code: str | None = None, field: str | None = None, **extra):
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.field = field
        self.extra = extra

    def as_dict(self) -> dict:
        body = {"code": self.code, "message": self.message, "field": self.field}
        body.update(self.extra)
        return body


class InvalidInput(ServiceError):
    http_status = 400
    default_code = "invalid"


class PayloadTooLarge(ServiceError):
    http_status = 413
    default_code = "too_large"


class Forbidden(ServiceError):
    http_status = 403
    default_code = "forbidden"

    def __init__(self, message: str = "forbidden", **kwargs):
        super().__init__(message, **kwargs)


class PreconditionFailed(ServiceError):
    http_status = 412
    default_code = "precondition_failed"


class Unprocessable(ServiceError):
    """Well-formed, but cannot be done as asked (an Idempotency-Key reused for another request)."""

    http_status = 422
    default_code = "unprocessable"


class NotFound(ServiceError):
    """Nothing there for this caller: missing, or another tenant's, or outside the key's
    allowlist — indistinguishable on purpose. ``field`` names what was looked up."""

    http_status = 404
    default_code = "not_found"


class Erased(NotFound):
    """The memory's value was crypto-shredded: its data key is destroyed (a completed forget),
    so nothing can read it any more. Audited as ``not_found``; REST answers 410."""

    http_status = 410
    default_code = "erased"

    def __init__(self, message: str = "this value was erased: its encryption key is destroyed", **kwargs):
        kwargs.setdefault("field", "key")
        super().__init__(message, **kwargs)


class Conflict(ServiceError):
    """The thing moved: a newer version (``current_version``), or a live memory holding the
    key a restore wanted."""

    http_status = 409
    default_code = "conflict"


class TenantBusy(ServiceError):
    """The tenant already runs as much expensive work (search, recall, export, batch) at
    once as it may; ``retry_after`` seconds."""

    http_status = 429
    default_code = "tenant_busy"


class Unavailable(ServiceError):
    """The work could not be done now (a search past its time limit): retry after
    ``retry_after`` seconds. Surfaces answer 503 with a Retry-After header."""

    http_status = 503
    default_code = "unavailable"


class Unauthenticated(ServiceError):
    """The credentials were missing, malformed, unknown, revoked or expired (``code`` says
    which). Surfaces answer 401 with ``WWW-Authenticate: Bearer``."""

    http_status = 401
    default_code = "invalid_credentials"
