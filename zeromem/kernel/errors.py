"""Errors the service layer raises. Every surface maps them the same way.

``not_found`` and ``conflict`` are *not* errors: they are normal results that go back to
the model. These exceptions are for calls that are wrong or not allowed.
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
        self.audited = False  # set once a service has written the audit event for it

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


class Unavailable(ServiceError):
    """The work could not be done now (a search past its time limit): retry after
    ``retry_after`` seconds. Surfaces answer 503 with a Retry-After header."""

    http_status = 503
    default_code = "unavailable"
