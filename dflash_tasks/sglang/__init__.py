"""The SGLang HTTP client and its error hierarchy."""
from dflash_tasks.sglang.client import Completion, Generation, ServerContract, SGLangClient
from dflash_tasks.sglang.errors import (
           PERMANENT_REASONS,
           REASONS,
           TRANSIENT_REASONS,
           BadResponse,
           EmptyResponse,
           InvalidRequest,
           ModelNotFound,
           PermanentError,
           RequestAborted,
           RequestTimeout,
           ServerUnavailable,
           SGLangError,
           TransientError,
)

__all__ = ["Completion", "Generation", "SGLangClient", "ServerContract", "SGLangError", "TransientError", "PermanentError",
           "ServerUnavailable", "RequestTimeout", "BadResponse", "InvalidRequest", "ModelNotFound",
           "EmptyResponse", "RequestAborted", "REASONS", "TRANSIENT_REASONS",
           "PERMANENT_REASONS"]
