"""The SGLang HTTP client and its error hierarchy."""
from dflash_tasks.sglang.client import Completion, Generation, ServerContract, SGLangClient
from dflash_tasks.sglang.errors import (
    DEPLOYMENT_REASONS,
    PERMANENT_REASONS,
    REASONS,
    TRANSIENT_REASONS,
    BadResponse,
    DeploymentError,
    EmptyResponse,
    InvalidRequest,
    ModelChanged,
    PermanentError,
    RequestAborted,
    RequestTimeout,
    ServerInfoUnreadable,
    ServerNotFound,
    ServerUnavailable,
    SGLangError,
    TransientError,
    Unauthorized,
)

__all__ = ["Completion", "Generation", "SGLangClient", "ServerContract", "SGLangError",
           "TransientError", "PermanentError", "DeploymentError", "ServerUnavailable",
           "RequestTimeout", "BadResponse", "InvalidRequest", "EmptyResponse", "RequestAborted",
           "ServerNotFound", "Unauthorized", "ServerInfoUnreadable", "ModelChanged", "REASONS",
           "TRANSIENT_REASONS", "PERMANENT_REASONS", "DEPLOYMENT_REASONS"]
