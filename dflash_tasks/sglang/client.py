"""One SGLang server, over HTTP: chat completions, health, model name, server info and the
thinking contract it holds (its chat template and reasoning parser).

One client per worker process, shared by its threads (httpx.Client is thread-safe), so
connections are reused; every failure surfaces as an `errors.SGLangError` subclass.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from dflash_tasks.sglang.errors import (
    BadResponse,
    EmptyResponse,
    ModelChanged,
    RequestAborted,
    RequestTimeout,
    ServerInfoUnreadable,
    ServerNotFound,
    ServerUnavailable,
    SGLangError,
    error_for_status,
)


@dataclass(frozen=True, slots=True)
class Completion:
    content: str
    reasoning_content: str | None
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    model: str
    latency_s: float
    prompt_token_ids: list[int] | None = None
    response_token_ids: list[int] | None = None
    matched_stop: Any = None
    continued_tokens: int = 0  # tokens kept from an earlier, truncated output (not regenerated)
    # Every GPU's share (ongoing.Share), in order, of an output made in more than one request
    # (rounds, a move, regenerate --continue); empty for one request's.
    worked: tuple = ()


@dataclass(frozen=True, slots=True)
class Generation:
    """A native /generate answer (see tests/sglang_samples/generate*.json)."""
    text: str
    output_ids: list[int]
    finish_reason: str
    completion_tokens: int
    cached_tokens: int
    latency_s: float
    matched_stop: Any = None


# The /server_info fields (SGLang's server arguments) that decide which chat template renders a
# prompt: --chat-template (null: the tokenizer's own) and the tokenizer it comes from.
TEMPLATE_FIELDS = ("chat_template", "tokenizer_path", "revision")


@dataclass(frozen=True, slots=True)
class ServerContract:
    """What the server, not the request, decides about a thinking-mode row: which chat template
    rendered the prompt (a fingerprint) and which reasoning parser split the reasoning from the
    answer (None: none, so the reasoning stays in `content`)."""
    chat_template: str
    reasoning_parser: str | None

    @classmethod
    def from_server_info(cls, info: dict) -> ServerContract:
        identity = json.dumps({k: info.get(k) for k in TEMPLATE_FIELDS}, sort_keys=True)
        parser = info.get("reasoning_parser")
        return cls("sha256:" + hashlib.sha256(identity.encode()).hexdigest()[:16],
                   str(parser) if parser else None)


@dataclass
class SGLangClient:
    base_url: str
    connect_timeout_s: float = 10.0
    request_timeout_s: float = 1800.0
    keepalive_expiry_s: float = 4.0
    # A worker sizes this from its concurrency (WorkerRuntime.pool_size): every thread may be
    # in a request at once, and a thread waiting for a connection leaves a decode slot idle.
    max_connections: int = 256
    _http: httpx.Client = field(init=False, repr=False)
    _model: str | None = field(default=None, init=False, repr=False)
    _contract: ServerContract | None = field(default=None, init=False, repr=False)
    _context: int | None = field(default=None, init=False, repr=False)
    _think_end: tuple[int, ...] | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url,
            timeout=httpx.Timeout(self.request_timeout_s, connect=self.connect_timeout_s),
            limits=httpx.Limits(max_connections=self.max_connections,
                                max_keepalive_connections=self.max_connections,
                                keepalive_expiry=self.keepalive_expiry_s),
        )

    def close(self) -> None:
        self._http.close()

    # -- probes ---------------------------------------------------------------------------------

    def healthy(self, timeout_s: float = 5.0) -> bool:
        """True when /health answers 200. A 503 also means 'starting' or 'busy with a long
        prefill', so callers decide on several probes, never on one."""
        return self.health(timeout_s)[0] == 200

    def health(self, timeout_s: float = 5.0) -> tuple[int | None, str]:
        """/health's status code and what it means, or None and why nothing answered."""
        try:
            status = self._http.get("/health", timeout=timeout_s).status_code
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}"[:300]
        return status, {200: "healthy", 503: "starting, or busy"}.get(status, f"HTTP {status}")

    def wait_healthy(self, timeout_s: float, interval_s: float = 1.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.healthy():
                return True
            time.sleep(interval_s)
        return False

    def served_model(self) -> str:
        """The exact served model name from /v1/models (a guessed name with ':' would be read as
        a LoRA adapter). Cached: a server keeps its name for life, and a server restarted with
        another model is found out (model_now) rather than followed."""
        with self._lock:
            if self._model is None:
                self._model = self._read_model()
            return self._model

    def _read_model(self) -> str:
        data = self._get_identity("/v1/models")
        try:
            return str(data["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise ServerInfoUnreadable(f"/v1/models lists no model: {str(data)[:200]}",
                                       url=self.base_url) from None

    def context_length(self) -> int | None:
        """The model's context length in tokens (/v1/models' max_model_len), None when the
        server does not say. Cached, as the name."""
        with self._lock:
            if self._context is None:
                data = self._get_identity("/v1/models")
                try:
                    self._context = int(data["data"][0]["max_model_len"])
                except (KeyError, IndexError, TypeError, ValueError):
                    self._context = 0
            return self._context or None

    def identity_ok(self) -> bool:
        """Whether the URL answers as the SGLang this client first met: /server_info readable and
        /v1/models serving the same model (a misconfigured GPU's breaker probes this, not
        /health, which a wrong server may well answer)."""
        try:
            self._get_identity("/server_info")
            model = self._read_model()
        except SGLangError:
            return False
        return self._model is None or model == self._model

    def _get_identity(self, path: str) -> Any:
        """A JSON object from one of the server's own endpoints; anything else there is a
        deployment fault (another product, a proxy page), not a passing one."""
        try:
            data = self._get_json(path)
        except BadResponse as exc:
            raise ServerInfoUnreadable(f"{path}: {exc.message}", url=self.base_url) from None
        if not isinstance(data, dict):
            raise ServerInfoUnreadable(f"{path} is not an object: {str(data)[:200]}",
                                       url=self.base_url)
        return data

    def metrics_text(self) -> str:
        """The server's Prometheus /metrics (SGLang serves it with --enable-metrics)."""
        try:
            response = self._http.get("/metrics", timeout=10.0)
        except httpx.HTTPError as exc:
            raise ServerUnavailable(f"{type(exc).__name__}: {exc}", url=self.base_url + "/metrics") from exc
        if response.status_code != 200:
            raise error_for_status(response.status_code, _error_message(response),
                                   self.base_url + "/metrics")
        return response.text

    def server_info(self) -> dict:
        return self._get_identity("/server_info")

    def contract(self) -> ServerContract:
        """The server's chat template fingerprint and reasoning parser, from /server_info (its
        launch arguments). Cached, like the model name: a server keeps its arguments for life."""
        with self._lock:
            if self._contract is None:
                self._contract = ServerContract.from_server_info(self.server_info())
            return self._contract

    # -- generation -----------------------------------------------------------------------------

    def chat(self, messages: list[dict], *, max_tokens: int, sampling: dict | None = None,
             enable_thinking: bool = True, rid: str | None = None,
             seed: int | None = None) -> Completion:
        """One chat completion. `sampling`: GenerationParams.sampling(), sent whole so that the
        server fills nothing in from the model's generation_config.json (see generate); `seed`:
        jobs.request_seed."""
        body: dict[str, Any] = {
            "model": self.served_model(),
            "messages": messages,
            "max_tokens": max_tokens,
            "chat_template_kwargs": {"enable_thinking": enable_thinking},
            "separate_reasoning": True,
            "return_token_ids": True,
            "stream": False,
        }
        body.update(sampling or {})
        if seed is not None:
            body["seed"] = seed
        if rid is not None:
            body["rid"] = rid
        started = time.monotonic()
        try:
            data = self._post_json("/v1/chat/completions", body)
        except ServerNotFound as exc:
            self._raise_if_model_changed()
            raise exc from None
        return parse_chat(data, latency_s=time.monotonic() - started, url=self.base_url)

    def _raise_if_model_changed(self) -> None:
        """After a 404 for the model this client sends: a server restarted with another model
        says so here (ModelChanged); otherwise the 404 stands."""
        try:
            now = self._read_model()
        except SGLangError:
            return
        if self._model is not None and now != self._model:
            raise ModelChanged(f"the server serves {now!r} now, not {self._model!r} (restarted "
                               "with another model?): restart this worker to generate with it",
                               url=self.base_url)

    def generate(self, input_ids: list[int], *, max_new_tokens: int, sampling: dict | None = None,
                 rid: str | None = None, seed: int | None = None) -> Generation:
        """Native /generate from token ids: how a generation goes on from its ids (the prefix
        cache serves the ids already known). Unlike the chat endpoint it takes nothing from the
        model's generation_config.json, so `sampling` must be the chat request's, whole."""
        params: dict[str, Any] = {**(sampling or {}), "max_new_tokens": max_new_tokens,
                                  **({"sampling_seed": seed} if seed is not None else {})}
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": params, "stream": False}
        if rid is not None:
            body["rid"] = rid
        started = time.monotonic()
        data = self._post_json("/generate", body)
        return parse_generate(data, latency_s=time.monotonic() - started, url=self.base_url)

    def detokenize(self, ids: list[int]) -> str:
        """The text of `ids` decoded at once by the server's own tokenizer (/v1/detokenize),
        special tokens skipped as the chat endpoint skips them: a generation's text, whatever
        requests it was made in (a character split across two of them decodes whole)."""
        data = self._post_json("/v1/detokenize", {"model": self.served_model(), "tokens": ids,
                                                  "skip_special_tokens": True})
        if not isinstance(data, dict) or not isinstance(data.get("text"), str):
            raise BadResponse(f"/v1/detokenize answered no text: {str(data)[:200]}",
                              url=self.base_url)
        return data["text"]

    def think_end_ids(self) -> tuple[int, ...]:
        """The ids of `</think>` in the server's vocabulary (/v1/tokenize), which end the tokens
        SGLang counts as reasoning. Cached, as the model name."""
        if self._think_end is None:  # two threads may both ask: the answer is the same
            data = self._post_json("/v1/tokenize", {"model": self.served_model(),
                                                    "prompt": "</think>",
                                                    "add_special_tokens": False})
            tokens = data.get("tokens") if isinstance(data, dict) else None
            if not tokens or not all(isinstance(t, int) for t in tokens):
                raise BadResponse(f"/v1/tokenize answered no ids for </think>: "
                                  f"{str(data)[:200]}", url=self.base_url)
            self._think_end = tuple(tokens)
        return self._think_end

    def abort(self, rid: str) -> None:
        """Ask the server to stop a request we gave up on (best effort)."""
        try:
            self._http.post("/abort_request", json={"rid": rid}, timeout=5.0)
        except httpx.HTTPError:
            pass

    # -- plumbing -------------------------------------------------------------------------------

    def _get_json(self, path: str) -> Any:
        return self._request("GET", path)

    def _post_json(self, path: str, body: dict) -> Any:
        return self._request("POST", path, json=body)

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        url = self.base_url + path
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TimeoutException as exc:
            raise RequestTimeout(f"{type(exc).__name__}: no answer in time", url=url) from exc
        except httpx.TransportError as exc:
            raise ServerUnavailable(f"{type(exc).__name__}: {exc}", url=url) from exc
        if response.status_code != 200:
            raise error_for_status(response.status_code, _error_message(response), url)
        try:
            return response.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadResponse(f"not JSON: {response.text[:200]!r}", url=url) from exc


def _error_message(response: httpx.Response) -> str:
    try:
        data = response.json()
        if isinstance(data, dict) and isinstance(data.get("message"), str):
            return data["message"]
    except ValueError:
        pass
    return response.text[:500] or response.reason_phrase


def parse_generate(data: Any, *, latency_s: float, url: str = "") -> Generation:
    """A /generate body: text, output_ids, meta_info with finish_reason as an object."""
    try:
        meta = data["meta_info"]
        finish = meta.get("finish_reason") or {}
        reason = finish.get("type", "unknown") if isinstance(finish, dict) else str(finish)
        g = Generation(text=data.get("text") or "", output_ids=list(data["output_ids"]),
                       finish_reason=reason, completion_tokens=int(meta["completion_tokens"]),
                       cached_tokens=int(meta.get("cached_tokens") or 0), latency_s=latency_s,
                       matched_stop=finish.get("matched") if isinstance(finish, dict) else None)
        if reason == "abort":
            raise RequestAborted(f"request aborted: {finish.get('message', '')}", url=url,
                                 partial=g)
        return g
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise BadResponse(f"unexpected /generate shape ({exc!r}): {json.dumps(data)[:300]}",
                          url=url) from exc


def _partial_chat(data: dict, latency_s: float) -> Completion | None:
    """What an aborted chat answer carries: its partial output, with its token ids (the request
    set return_token_ids); None when it lacks them (nothing to go on from)."""
    try:
        choice, usage = data["choices"][0], data["usage"]
        message = choice.get("message") or {}
        if choice.get("response_token_ids") is None or choice.get("prompt_token_ids") is None:
            return None
        details = usage.get("completion_tokens_details") or {}
        return Completion(
            content=message.get("content") or "", reasoning_content=message.get("reasoning_content"),
            finish_reason="abort", prompt_tokens=int(usage["prompt_tokens"]),
            completion_tokens=len(choice["response_token_ids"]),
            reasoning_tokens=int(details.get("reasoning_tokens") or usage.get("reasoning_tokens") or 0),
            model=data.get("model", ""), latency_s=latency_s,
            prompt_token_ids=choice["prompt_token_ids"],
            response_token_ids=choice["response_token_ids"])
    except (KeyError, TypeError, ValueError, AttributeError, IndexError):
        return None


def parse_chat(data: Any, *, latency_s: float, url: str = "") -> Completion:
    """A /v1/chat/completions body (see tests/sglang_samples/chat*.json) as a Completion."""
    if not isinstance(data, dict):
        raise BadResponse(f"expected a JSON object, got {type(data).__name__}", url=url)
    choices = data.get("choices")
    if not choices:
        raise EmptyResponse(f"response has no choices: {json.dumps(data)[:300]}", url=url)
    try:
        choice = choices[0]
        if choice.get("finish_reason") == "abort":
            # Aborted on the server (/abort_request, a scheduler restart): not an answer, but
            # what was generated before it, for a generation moved to another GPU.
            raise RequestAborted("the server aborted the request (finish_reason 'abort')", url=url,
                                 partial=_partial_chat(data, latency_s))
        message = choice["message"]
        usage = data["usage"]
        details = usage.get("completion_tokens_details") or {}
        return Completion(
            content=message.get("content") or "",
            reasoning_content=message.get("reasoning_content"),
            finish_reason=choice.get("finish_reason") or "unknown",
            prompt_tokens=int(usage["prompt_tokens"]),
            completion_tokens=int(usage["completion_tokens"]),
            reasoning_tokens=int(details.get("reasoning_tokens") or usage.get("reasoning_tokens") or 0),
            model=data.get("model", ""),
            latency_s=latency_s,
            prompt_token_ids=choice.get("prompt_token_ids"),
            response_token_ids=choice.get("response_token_ids"),
            matched_stop=choice.get("matched_stop"),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise BadResponse(f"unexpected response shape ({exc!r}): {json.dumps(data)[:300]}",
                          url=url) from exc


__all__ = ["Completion", "SGLangClient", "ServerContract", "SGLangError", "parse_chat"]
