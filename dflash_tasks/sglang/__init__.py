"""The SGLang HTTP client and its error hierarchy."""
from .client import Completion, SGLangClient
from .errors import (BadResponse, EmptyResponse, InvalidRequest, ModelNotFound, PermanentError,
                     RequestTimeout, ServerUnavailable, SGLangError, TransientError)

__all__ = ["Completion", "SGLangClient", "SGLangError", "TransientError", "PermanentError",
           "ServerUnavailable", "RequestTimeout", "BadResponse", "InvalidRequest", "ModelNotFound",
           "EmptyResponse"]
