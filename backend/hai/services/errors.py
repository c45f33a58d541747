"""Errors services raise; api/errors.py maps them to HTTP."""

from __future__ import annotations


class ServiceError(Exception):
    status_code = 400

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class Unauthorized(ServiceError):
    status_code = 401


class Forbidden(ServiceError):
    status_code = 403


class NotFound(ServiceError):
    status_code = 404


class Conflict(ServiceError):
    status_code = 409


class ChecksFailed(Conflict):
    """An undrain refused because critical validator checks failed (issue 10). The body names
    them: {"detail": {"message": ..., "failed_checks": [{name, value, threshold, unit, detail}]}}."""

    def __init__(self, message: str, failed_checks: list[dict]):
        super().__init__(message)
        self.failed_checks = failed_checks

    @property
    def body(self) -> dict:
        return {"message": self.message, "failed_checks": self.failed_checks}


class TooMany(ServiceError):
    """A limit was reached (issue 13): 429, with ``Retry-After`` when waiting helps."""

    status_code = 429

    def __init__(self, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Invalid(ServiceError):
    """A request that is well-formed but cannot be accepted; reported like a validation error."""

    status_code = 422

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class UnsupportedProtocol(ServiceError):
    status_code = 426

    def __init__(self, message: str, supported: frozenset[int]):
        super().__init__(message)
        self.supported = supported  # the versions the server speaks (a 426 lists them)
