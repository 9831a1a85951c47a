"""What can go wrong with a request to SGLang, classified once, here, by whose fault it is, so
callers never parse strings.

    SGLangError
    ├── TransientError      the server's, for now: retry with backoff, the same request may well
    │   │                   succeed later (the breaker stops sending while it lasts)
    │   ├── ServerUnavailable   connection refused/reset, 429, 5xx, a server starting or restarting
    │   ├── RequestTimeout      no complete answer within the client's timeouts (also HTTP 408)
    │   ├── BadResponse         a body that is not the JSON SGLang sends (proxy page, cut-off body)
    │   └── RequestAborted      a 200 whose finish_reason is "abort" (aborted on the server)
    ├── PermanentError      the prompt's: do not retry, the same request fails the same way
    │   ├── InvalidRequest      HTTP 400 (prompt longer than the context, a malformed
    │   │                       conversation), 413, other 4xx about the request
    │   └── EmptyResponse       a 200 without choices
    └── DeploymentError     the deployment's: what answers at the URL is not the SGLang it should
        │                   be. No prompt can succeed there, and none is to blame: the GPU stops
        │                   taking work (its breaker opens at once) and its prompts go elsewhere
        ├── ServerNotFound      HTTP 404 on the server's own endpoints (a wrong port, a proxy path,
        │                       another product, a model name it does not serve)
        ├── Unauthorized        HTTP 401/403 (a proxy in front of the server)
        ├── ServerInfoUnreadable  /server_info or /v1/models answers 200 with something else
        └── ModelChanged        the server now serves another model than the one this worker's
                                rows were generated with (restarted with another model)

`reason` is the short, stable name the failed registry, the counters, the breakers and `manage.py
failed --reason` use; REASONS lists those of prompt failures with their class.
"""
from __future__ import annotations

import re


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
    """Aborted on the server (our /abort_request, a scheduler restart). SGLang still answers
    with what it had generated: `partial` (a client.Completion or client.Generation), when the
    answer carried it, which lets a generation moved to another GPU go on from there."""
    reason = "aborted"

    def __init__(self, message: str, *, url: str = "", status: int | None = None,
                 partial: object = None):
        super().__init__(message, url=url, status=status)
        self.partial = partial


class PermanentError(SGLangError):
    reason = "permanent"


# SGLang's 400 for a prompt plus max_tokens beyond the model's context (err_maxtok.txt), and
# the wording of its other context checks.
_CONTEXT = re.compile(r"context length|context window|longer than the model", re.IGNORECASE)


class InvalidRequest(PermanentError):
    reason = "invalid_request"

    @property
    def context_too_long(self) -> bool:
        """The prompt plus the job's max_tokens exceed the model's context: a fault of this
        prompt at this cap, which a lower cap mends."""
        return bool(_CONTEXT.search(self.message))


class EmptyResponse(PermanentError):
    reason = "empty_response"


class DeploymentError(SGLangError):
    reason = "deployment"


class ServerNotFound(DeploymentError):
    reason = "server_not_found"


class Unauthorized(DeploymentError):
    reason = "unauthorized"


class ServerInfoUnreadable(DeploymentError):
    reason = "server_info_unreadable"


class ModelChanged(DeploymentError):
    reason = "model_changed"


def error_for_status(status: int, message: str, url: str) -> SGLangError:
    if status == 404:
        return ServerNotFound(message, url=url, status=status)
    if status in (401, 403):
        return Unauthorized(message, url=url, status=status)
    if status == 408:
        return RequestTimeout(message, url=url, status=status)
    if status == 429 or status >= 500:
        return ServerUnavailable(message, url=url, status=status)
    # 400 and the other 4xx (413, 422...): the request's content, which will not fix itself.
    return InvalidRequest(message, url=url, status=status)


def _reasons(base: type[SGLangError]) -> tuple[str, ...]:
    """The reasons of a class and of every class below it, each written once, on its class."""
    return (base.reason, *(r for sub in base.__subclasses__() for r in _reasons(sub)))


TRANSIENT_REASONS = _reasons(TransientError)
# model_not_found: a 404 failed prompts before 404s were the deployment's (old registry entries).
PERMANENT_REASONS = (*_reasons(PermanentError), "model_not_found")
REASONS = TRANSIENT_REASONS + PERMANENT_REASONS
DEPLOYMENT_REASONS = _reasons(DeploymentError)
