"""What can go wrong with a request to SGLang, classified once, here, so callers never parse strings.

    SGLangError
    ├── TransientError      retry with backoff: the same request may well succeed later
    │   ├── ServerUnavailable   connection refused/reset, 429, 5xx, a server starting or restarting
    │   ├── RequestTimeout      no complete answer within the client's timeouts (also HTTP 408)
    │   ├── BadResponse         a body that is not the JSON SGLang sends (proxy page, cut-off body)
    │   └── RequestAborted      a 200 whose finish_reason is "abort" (aborted on the server)
    └── PermanentError      do not retry: the same request will fail the same way
        ├── InvalidRequest      HTTP 400 (prompt longer than the context, bad parameters), other 4xx
        ├── ModelNotFound       HTTP 404
        └── EmptyResponse       a 200 without choices

`reason` is the short, stable name the failed registry, the counters and `manage.py failed
--reason` use; `REASONS` lists them with their class.
"""
from __future__ import annotations


class SGLangError(Exception):
    """Base class. `reason` is a short stable class name for registries and metrics."""

    reason = "error"
    transient = False

    def __init__(self, message: str, *, url: str = "", status: int | None = None):
        super().__init__(message)
        self.message = message
        self.url = url
        self.status = status

    def __str__(self) -> str:
        where = f" ({self.url})" if self.url else ""
        code = f"HTTP {self.status}: " if self.status else ""
        return f"{code}{self.message}{where}"


class TransientError(SGLangError):
    transient = True
    reason = "transient"


class ServerUnavailable(TransientError):
    reason = "unavailable"


class RequestTimeout(TransientError):
    reason = "timeout"


class BadResponse(TransientError):
    reason = "bad_response"


class RequestAborted(TransientError):
    reason = "aborted"


class PermanentError(SGLangError):
    reason = "permanent"


class InvalidRequest(PermanentError):
    reason = "invalid_request"


class ModelNotFound(PermanentError):
    reason = "model_not_found"


class EmptyResponse(PermanentError):
    reason = "empty_response"


def error_for_status(status: int, message: str, url: str) -> SGLangError:
    if status == 400:
        return InvalidRequest(message, url=url, status=status)
    if status == 404:
        return ModelNotFound(message, url=url, status=status)
    if status == 408:
        return RequestTimeout(message, url=url, status=status)
    if status == 429 or status >= 500:
        return ServerUnavailable(message, url=url, status=status)
    # Other 4xx (401/403 from a proxy, 413...) will not fix themselves.
    return InvalidRequest(message, url=url, status=status)


TRANSIENT_REASONS = ("transient", "unavailable", "timeout", "bad_response", "aborted")
PERMANENT_REASONS = ("permanent", "invalid_request", "model_not_found", "empty_response")
REASONS = TRANSIENT_REASONS + PERMANENT_REASONS
