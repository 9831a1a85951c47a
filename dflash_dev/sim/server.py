"""The simulated SGLang server: SGLang 0.5.23's HTTP API over a model of decode slots, no GPU.

One asyncio process. A generation request (`/v1/chat/completions` or `/generate`) waits FIFO for
one of `slots` decode slots, holds it for prefill + completion/decode_tps seconds (times the slow
factor), then answers in SGLang's exact JSON shapes (as captured from SGLang 0.5.23; the tests
hold the key lists and error messages). What it answers is deterministic per prompt (see `lengths`
and `tokens`): `usage.reasoning_tokens` counts the tokens up to and including `</think>` (as SGLang does), and
`completion_tokens` equals `len(response_token_ids)`, markers and `<|im_end|>` included.

`/generate` with `input_ids` = a chat's prompt ids + some of its response ids continues the same
sequence (the prompt ends at the last `<|im_start|>assistant`, plus the empty think block when
thinking is off); a prompt seen before reports `cached_tokens` = len(input_ids) - 1, as the radix
cache would. A continuation that starts at or past the natural end answers 0 tokens, "stop".

Faults are drawn per generation request, in arrival order, from a `random.Random(seed)`: a 503
with SGLang's JSON error body, a reset connection (the transport is aborted after a short time),
or a hang (no byte at all for `hang_seconds`, no slot held, then the connection is dropped).
`POST /sim/down` closes the listening socket, resets every open connection, forgets every request
in flight and listens again on the same port after the given seconds, as a crashed and restarted
server would look to its clients. `POST /sim/hold` holds every answer (a generation that ends
waits, unanswered; an aborted one is answered at once, its partial output and all, as SGLang
answers an abort) until `POST /sim/release`: a test acts mid-run at a point it chose, instead of
racing a run that a fast or a slow machine ends sooner or later. `{"after": N}` lets N more
answers through first: the run stops at that point however fast the machine.

Decisions where SGLang's own behaviour was not the point:
- `stream: true` is refused with a 400 (the project only uses non-streaming requests);
- during `--startup-seconds`, `/health` and the generation endpoints answer 503;
- an abort answers HTTP 200 with finish_reason "abort" and the tokens decoded so far;
- `/abort_request` matches rids by prefix, as SGLang's scheduler does (`req.rid.startswith(rid)`);
  an empty rid or `abort_all` aborts everything;
- `/v1/loads` omits per-rank fields at their default (zero), as SGLang 0.5.23's msgspec structs do;
- a dropped client connection does not stop its request: it keeps its slot until done or aborted;
- idle keep-alive connections are closed after 5 s, like SGLang's uvicorn;
- `/metrics` has no `sglang:max_running_requests` (0.5.23 has none): `/server_info` and
  `/v1/loads` carry `max_running_requests`;
- `/sim/down` keeps `/sim/stats` and the Prometheus counters (a real restart would zero the
  latter) but empties the prefix cache.
"""
from __future__ import annotations

import asyncio
import bisect
import json
import math
import os
import random
import signal
import time
from collections import Counter, OrderedDict, deque
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any, Sequence

from aiohttp import web

from dflash_dev.sim import lengths, tokens

VERSION = "0.5.23"
_LATENCY_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0,
                    100.0, 200.0, 400.0, 600.0, 1200.0, 1800.0, 2400.0)
_SEEN_PREFIXES = 200_000  # prompt keys the "radix cache" remembers
_HANG_POLL_SECONDS = 0.5


@dataclass
class SimConfig:
    host: str = "127.0.0.1"
    port: int = 0
    slots: int = 40
    max_queued: int = 0
    decode_tps: float = 2000.0
    prefill_tps: float = 200000.0
    model_name: str = "Qwen/Qwen3-8B"
    context_length: int = 40960
    median_tokens: float = 1800.0
    p_over_4096: float = 0.18
    fixed_tokens: int = 0
    # The share of prompts whose output falls into a loop and runs to any cap (lengths.loop_of).
    loop_share: float = 0.0
    # "fixed": every request for a prompt gets its one output (benchmarks compute every length in
    # advance); "random": a request at a temperature above 0 draws one of the prompt's outputs at
    # random, and a continuation goes on with the one its ids began (lengths.plan_response).
    sampling: str = "fixed"
    startup_seconds: float = 0.0
    fail_503: float = 0.0
    reset_rate: float = 0.0
    hang_rate: float = 0.0
    hang_seconds: float = 3600.0
    seed: int = 0
    slow_factor: float = 1.0
    # SGLang's --reasoning-parser (None: off, the reasoning stays in `content`) and
    # --chat-template (None: the tokenizer's own); both answered in /server_info and /model_info.
    # The rendering stays Qwen3's whatever the template is called: only its name changes.
    reasoning_parser: str | None = "qwen3"
    chat_template: str | None = None
    # "words" (one `w<id>` word per token) or "bytes" (a byte-level tokenizer: tokens.py).
    tokenizer: str = "words"
    # The model's generation_config.json sampling defaults, which the chat endpoint fills into a
    # request that leaves them unset (SGLang's `--sampling-defaults model`) and /generate never
    # does; each request's effective parameters are kept for /sim/sampling.
    generation_config: dict | None = None


class BadRequest(Exception):
    """A request SGLang would refuse; `body` is the JSON it answers with."""

    def __init__(self, status: int, body: dict, kind: str = "bad_request"):
        super().__init__(body)
        self.status = status
        self.body = body
        self.kind = kind


def openai_error(status: int, message: str, err_type: str) -> dict:
    return {"object": "error", "message": message, "type": err_type, "param": None, "code": status}


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(body, separators=(",", ":")).encode(), status=status,
                        content_type="application/json")


class Generation:
    """One generation request in the model of the GPU."""

    __slots__ = ("rid", "plan", "start", "budget", "completion", "finish", "cached", "arrived",
                 "started", "prefill_s", "token_s", "waiter", "done", "cancel")

    def __init__(self, rid: str, plan: lengths.ResponsePlan, start: int, budget: int, cached: int):
        self.rid = rid
        self.plan = plan
        self.start = start  # response position the generation starts at (> 0 for continuations)
        self.budget = budget
        self.completion, self.finish = plan.outcome(start, budget)
        self.cached = cached
        self.arrived = time.time()
        self.started = 0.0
        self.prefill_s = 0.0
        self.token_s = 0.0
        self.waiter: asyncio.Future | None = None
        self.done: asyncio.Future | None = None
        self.cancel: str | None = None  # "abort" or "killed" once asked to stop

    @property
    def input_tokens(self) -> int:
        return self.plan.prompt_tokens + self.start

    def decoded(self, now: float) -> int:
        """Tokens generated by `now` while holding a slot."""
        if not self.started or self.token_s <= 0:
            return 0
        return max(0, min(self.completion, int((now - self.started - self.prefill_s) / self.token_s)))


def _resolve(fut: asyncio.Future | None, value: Any) -> None:
    if fut is not None and not fut.done():
        fut.set_result(value)


class SimServer:
    """The simulation state and the aiohttp application that serves it."""

    def __init__(self, config: SimConfig):
        lengths.sigma_for(config.median_tokens, config.p_over_4096)  # refuse an impossible model early
        self.config = config
        if config.tokenizer not in ("words", "bytes"):
            raise ValueError(f"tokenizer must be words or bytes, not {config.tokenizer!r}")
        if config.sampling not in ("fixed", "random"):
            raise ValueError(f"sampling must be fixed or random, not {config.sampling!r}")
        if config.sampling == "random" and config.tokenizer == "bytes":
            raise ValueError("--sampling random says its salt in words: use --tokenizer words")
        self.byte_level = config.tokenizer == "bytes"
        # Each generation request's effective sampling parameters, newest last (/sim/sampling).
        self.sampling_seen: deque[dict] = deque(maxlen=100_000)
        self.faults = {"fail_503": config.fail_503, "reset_rate": config.reset_rate,
                       "hang_rate": config.hang_rate, "slow_factor": config.slow_factor}
        self._rng = random.Random(config.seed)
        # Sampled outputs' draws, seeded from the system like an SGLang server's own (its
        # --random-seed is random unless set): two servers never draw alike by accident.
        self._sampler = random.Random()
        self.started_at = time.time()
        self.up_at = self.started_at + config.startup_seconds
        self.down_until = 0.0
        self.answering: asyncio.Event | None = None  # cleared while /sim/hold holds the answers
        self.hold_after: int | None = None  # answers /sim/hold {"after": N} lets through still
        self.held = 0  # answers waiting for /sim/release
        self.port = config.port
        self.max_total_num_tokens = max(config.context_length, config.slots * 8192)
        # the decode slots
        self.running: set[Generation] = set()
        self.waiting: deque[Generation] = deque()
        self.active: set[Generation] = set()
        self._slots_taken = 0
        # the prefix cache: prompt key -> longest sequence (prompt + response) computed for it
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        # statistics
        self.requests = 0
        self.by_endpoint: Counter[str] = Counter()
        self.completed: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.max_running_seen = 0
        self.max_queued_seen = 0
        self.busy_slot_seconds = 0.0
        self.service_seconds_sum = 0.0
        self.queue_seconds_sum = 0.0
        self.first_request_at: float | None = None
        self.last_finished_at: float | None = None
        self.last_started_at: float | None = None  # when a request last got a slot
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.cached_tokens_total = 0
        self.finished_requests = 0
        self.down_count = 0
        self._latency_counts = [0] * (len(_LATENCY_BUCKETS) + 1)
        self._latency_sum = 0.0
        self.app = self._make_app()
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._background: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ lifecycle

    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        for path in ("/v1/detokenize", "/detokenize"):
            r.add_post(path, self.detokenize)
        for path in ("/v1/tokenize", "/tokenize"):
            r.add_post(path, self.tokenize)
        r.add_get("/sim/sampling", self.sim_sampling)
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        r.add_get("/v1/models", self.models)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/metrics", self.metrics)
        r.add_get("/sim/stats", self.sim_stats)
        r.add_post("/sim/faults", self.sim_faults)
        r.add_post("/sim/down", self.sim_down)
        r.add_post("/sim/hold", self.sim_hold)
        r.add_post("/sim/release", self.sim_release)
        return app

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None, keepalive_timeout=5.0,
                                     handle_signals=False)
        await self._runner.setup()
        await self._listen()

    async def _listen(self) -> None:
        self._site = web.TCPSite(self._runner, self.config.host, self.port, backlog=1024,
                                 reuse_address=True)
        await self._site.start()
        server = self._site._server  # the asyncio server: the only way to learn a port 0 choice
        if server is not None and server.sockets:
            self.port = server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self._kill_all()
        for task in list(self._background):
            task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def go_down(self, seconds: float, delay: float = 0.0) -> None:
        """Crash and restart: refuse connections for `seconds`, dropping everything in flight."""
        await asyncio.sleep(delay)
        self.down_count += 1
        self.down_until = time.time() + seconds
        if self._site is not None:
            await self._site.stop()
        for handler in self._runner.server.connections:
            if handler.transport is not None:
                handler.transport.abort()
        self._kill_all()
        self._seen.clear()
        await asyncio.sleep(seconds)
        await self._listen()
        self.down_until = 0.0

    def _kill_all(self) -> None:
        for gen in list(self.active):
            self._stop_generation(gen, "killed")

    @staticmethod
    def _stop_generation(gen: Generation, why: str) -> None:
        if gen.cancel is None:
            gen.cancel = why
        _resolve(gen.waiter, why)
        _resolve(gen.done, why)

    # ------------------------------------------------------------------ the slot model

    async def _run(self, gen: Generation) -> str:
        """Wait for a slot (FIFO), hold it for the generation's service time. Returns how it ended:
        "done", "abort" (aborted while running), "abort_waiting", "queue_full" or "killed"."""
        loop = asyncio.get_running_loop()
        config = self.config
        if self._slots_taken >= config.slots or self.waiting:
            if config.max_queued and len(self.waiting) >= config.max_queued:
                return "queue_full"
            gen.waiter = loop.create_future()
            self.waiting.append(gen)
            self.active.add(gen)
            self.max_queued_seen = max(self.max_queued_seen, len(self.waiting))
            try:
                granted = await gen.waiter
            finally:
                if gen in self.waiting:  # aborted or killed while waiting
                    self.waiting.remove(gen)
            if granted is not True:
                self.active.discard(gen)
                gen.completion = 0
                return "abort_waiting" if granted == "abort" else granted
        else:
            self._slots_taken += 1
            self.active.add(gen)
        now = time.time()
        gen.started = now
        self.last_started_at = now
        self.queue_seconds_sum += now - gen.arrived
        self.running.add(gen)
        self.max_running_seen = max(self.max_running_seen, len(self.running))
        slow = self.faults["slow_factor"]
        gen.prefill_s = max(0, gen.input_tokens - gen.cached) / config.prefill_tps * slow
        gen.token_s = slow / config.decode_tps
        service = gen.prefill_s + gen.completion * gen.token_s
        gen.done = loop.create_future()
        timer = loop.call_later(service, _resolve, gen.done, "done")
        if gen.cancel is not None:  # asked to stop between getting the slot and starting
            _resolve(gen.done, gen.cancel)
        try:
            outcome = await gen.done
        finally:
            timer.cancel()
            end = time.time()
            if gen.done.done() and gen.done.result() == "done":
                generated = gen.completion
            else:  # as SGLang, a running request aborted may still decode one more token
                generated = min(gen.completion, gen.decoded(end) + 1)
            self.running.discard(gen)
            self.active.discard(gen)
            self.busy_slot_seconds += end - gen.started
            self.service_seconds_sum += gen.prefill_s + generated * gen.token_s
            self._release_slot()
        gen.completion = generated
        return outcome

    def _release_slot(self) -> None:
        while self.waiting:
            nxt = self.waiting.popleft()
            if nxt.waiter is not None and not nxt.waiter.done():
                nxt.waiter.set_result(True)  # the slot passes straight to the next in line
                return
        self._slots_taken -= 1

    def _abort(self, rid: str, abort_all: bool) -> int:
        matched = [gen for gen in self.active if abort_all or gen.rid.startswith(rid)]
        for gen in matched:
            self._stop_generation(gen, "abort")
        return len(matched)

    def _cached_tokens(self, key: bytes, input_len: int) -> int:
        known = self._seen.get(key)
        if known is None:
            return 0
        self._seen.move_to_end(key)
        return min(input_len - 1, known)

    def _remember(self, key: bytes, length: int) -> None:
        if self._seen.get(key, -1) < length:
            self._seen[key] = length
        self._seen.move_to_end(key)
        while len(self._seen) > _SEEN_PREFIXES:
            self._seen.popitem(last=False)

    def _finish(self, gen: Generation, outcome: str) -> None:
        """Account a generation that got an answer (finished or aborted)."""
        now = time.time()
        self.last_finished_at = now
        reason = "abort" if outcome in ("abort", "abort_waiting") else gen.finish
        self.completed[reason] += 1
        self.finished_requests += 1
        self.prompt_tokens_total += gen.input_tokens
        self.cached_tokens_total += gen.cached
        self.generation_tokens_total += gen.completion
        latency = now - gen.arrived
        self._latency_sum += latency
        self._latency_counts[bisect.bisect_left(_LATENCY_BUCKETS, latency)] += 1
        self._remember(gen.plan.key, gen.plan.prompt_tokens + gen.start + gen.completion)

    # ------------------------------------------------------------------ faults

    def _draw_fault(self) -> tuple[str | None, float]:
        """The fault for the next generation request, in arrival order: (kind or None, a uniform)."""
        u, v = self._rng.random(), self._rng.random()
        f = self.faults
        if u < f["fail_503"]:
            return "503", v
        if u < f["fail_503"] + f["reset_rate"]:
            return "reset", v
        if u < f["fail_503"] + f["reset_rate"] + f["hang_rate"]:
            return "hang", v
        return None, v

    async def _apply_fault(self, request: web.Request, kind: str, v: float) -> web.StreamResponse:
        self.errors[kind if kind != "503" else "fault_503"] += 1
        if kind == "503":
            return _json(openai_error(503, "Service Unavailable", "503"), 503)
        if kind == "reset":
            await asyncio.sleep(0.01 + 0.09 * v)
            return self._drop(request)
        deadline = time.monotonic() + self.config.hang_seconds
        while time.monotonic() < deadline:
            transport = request.transport
            if transport is None or transport.is_closing():
                break
            await asyncio.sleep(min(_HANG_POLL_SECONDS, max(0.0, deadline - time.monotonic())))
        return self._drop(request)

    @staticmethod
    def _drop(request: web.Request) -> web.StreamResponse:
        """Reset the connection: the client sees it closed without a response."""
        if request.transport is not None:
            request.transport.abort()
        return web.Response()  # writing it fails quietly: the transport is gone

    def _unavailable(self) -> web.Response | None:
        if time.time() < self.up_at:
            self.errors["starting"] += 1
            return _json(openai_error(503, "The server is starting up.", "503"), 503)
        return None

    # ------------------------------------------------------------------ generation endpoints

    def _count_request(self, endpoint: str) -> None:
        self.requests += 1
        self.by_endpoint[endpoint] += 1
        if self.first_request_at is None:
            self.first_request_at = time.time()

    async def _serve_generation(self, request: web.Request, endpoint: str, parse, render) -> web.StreamResponse:
        """What both generation endpoints do: fault, parse, wait for and hold a slot, answer."""
        self._count_request(endpoint)
        kind, v = self._draw_fault()
        if kind is not None:
            return await self._apply_fault(request, kind, v)
        refused = self._unavailable()
        if refused is not None:
            return refused
        try:
            gen, params = parse(await request.read())
        except BadRequest as exc:
            self.errors[exc.kind] += 1
            return _json(exc.body, exc.status)
        outcome = await self._run(gen)
        if self.answering is not None and outcome not in ("abort", "abort_waiting"):
            if self.hold_after is not None:
                if self.hold_after == 0:
                    self.answering.clear()
                    self.hold_after = None
                else:
                    self.hold_after -= 1
            self.held += 1
            try:  # /sim/hold (an abort is answered at once, as SGLang does)
                await self.answering.wait()
            finally:
                self.held -= 1
        if outcome == "killed":
            self.errors["killed"] += 1
            return self._drop(request)
        if outcome == "queue_full":
            self.errors["queue_full"] += 1
            return _json(openai_error(503, "The request queue is full.", "503"), 503)
        self._finish(gen, outcome)
        return _json(render(gen, outcome, params))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve_generation(request, "chat", self._parse_chat, self._chat_body)

    def _parse_chat(self, raw: bytes) -> tuple[Generation, dict]:
        config = self.config
        data = _load_json(raw, "/v1/chat/completions", "openai_v1_chat_completions")
        messages = data.get("messages")
        if "messages" not in data:
            raise _validation_error("missing", ("body", "messages"), "Field required", data,
                                    "/v1/chat/completions", "openai_v1_chat_completions")
        if not isinstance(messages, list):
            raise _validation_error("list_type", ("body", "messages"), "Input should be a valid list",
                                    messages, "/v1/chat/completions", "openai_v1_chat_completions")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise _validation_error("model_attributes_type", ("body", "messages", i),
                                        "Input should be a valid dictionary or object to extract fields from",
                                        m, "/v1/chat/completions", "openai_v1_chat_completions")
        model = data.get("model", config.model_name)
        if model != config.model_name:
            raise BadRequest(404, openai_error(404, f"The model `{model}` does not exist.", "NotFoundError"),
                             "not_found")
        if data.get("stream"):
            raise BadRequest(400, openai_error(400, "The simulated server does not support stream=true.",
                                               "BadRequestError"))
        if not messages:
            raise BadRequest(400, openai_error(400, "Messages cannot be empty.", "BadRequestError"))
        _check_sampling(data)
        self._note_sampling("chat", data.get("rid"), data, defaults=config.generation_config)
        kwargs = data.get("chat_template_kwargs") or {}
        thinking = bool(kwargs.get("enable_thinking", True)) if isinstance(kwargs, dict) else True
        max_tokens = data.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = data.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 0):
            raise BadRequest(400, openai_error(400, f"max_tokens must be a non-negative integer, got {max_tokens!r}.",
                                               "BadRequestError"))
        prompt_ids = tokens.render_chat(messages, thinking)
        budget = _check_context(len(prompt_ids), max_tokens, config.context_length, openai=True)
        plan = self._plan(prompt_ids, thinking, data.get("temperature"))
        rid = data.get("rid")
        rid = rid if isinstance(rid, str) and rid else os.urandom(16).hex()
        gen = Generation(rid, plan, 0, budget, self._cached_tokens(plan.key, len(prompt_ids)))
        params = {"prompt_ids": prompt_ids if data.get("return_token_ids") else None,
                  "separate": data.get("separate_reasoning", True) is not False
                  and config.reasoning_parser is not None,
                  "thinking": thinking}
        return gen, params

    def _chat_body(self, gen: Generation, outcome: str, params: dict) -> dict:
        layout = gen.plan.layout
        n = gen.completion
        aborted = outcome in ("abort", "abort_waiting")
        finish = "abort" if aborted else gen.finish
        reasoning = layout.reasoning_tokens(n)
        text = layout.text(0, n)
        if params["separate"]:
            thought, content = split_reasoning(text, params["thinking"])
        else:
            thought, content = None, text
        message = {"role": "assistant", "content": content, "reasoning_content": thought}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish,
                  "matched_stop": tokens.IM_END if finish == "stop" else None}
        if params["prompt_ids"] is not None:
            choice["prompt_token_ids"] = params["prompt_ids"]
            choice["response_token_ids"] = layout.ids(0, n)
        prompt = gen.plan.prompt_tokens
        return {
            "id": gen.rid, "object": "chat.completion", "created": int(time.time()),
            "model": self.config.model_name, "choices": [choice],
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt + n, "completion_tokens": n,
                      "prompt_tokens_details": None, "reasoning_tokens": reasoning,
                      "completion_tokens_details": {"reasoning_tokens": reasoning} if reasoning else None},
            "metadata": {"weight_version": "default",
                         "weight_versions": [{"version": "default", "start": 0, "end": n}]},
        }

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._serve_generation(request, "generate", self._parse_generate, self._generate_body)

    def _parse_generate(self, raw: bytes) -> tuple[Generation, None]:
        config = self.config
        data = _load_json(raw, "/generate", "generate_request")
        input_ids, text = data.get("input_ids"), data.get("text")
        if input_ids is None and text is None:
            raise _native_error("Either text, input_ids or input_embeds should be provided.")
        if input_ids is None:
            if not isinstance(text, str):
                raise _native_error("The simulated server takes one text (a string) per request.")
            input_ids = tokens.encode(text)
        if (not isinstance(input_ids, list) or not input_ids
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in input_ids)):
            raise _native_error("input_ids must be a non-empty list of token ids.")
        if min(input_ids) < 0 or max(input_ids) >= tokens.VOCAB_SIZE:
            raise _native_error(f"The input_ids contain a token id outside the vocabulary [0, {tokens.VOCAB_SIZE}).")
        sampling = data.get("sampling_params") or {}
        if not isinstance(sampling, dict):
            raise _native_error("sampling_params must be an object.")
        _check_sampling(sampling, native=True)
        self._note_sampling("generate", data.get("rid"), sampling, defaults=None)
        max_new = sampling.get("max_new_tokens", 128)
        if max_new is not None and (not isinstance(max_new, int) or max_new < 0):
            raise _native_error(f"max_new_tokens must be a non-negative integer, got {max_new!r}.")
        budget = _check_context(len(input_ids), max_new, config.context_length, openai=False)
        end, thinking = tokens.split_prompt(input_ids)
        plan = self._plan(input_ids[:end], bool(thinking), sampling.get("temperature"),
                          so_far=input_ids[end:])
        rid = data.get("rid")
        rid = rid if isinstance(rid, str) and rid else os.urandom(16).hex()
        return Generation(rid, plan, len(input_ids) - end, budget, self._cached_tokens(plan.key, len(input_ids))), None

    def _plan(self, prompt_ids: list[int], thinking: bool, temperature: Any, *,
              so_far: Sequence[int] = ()) -> lengths.ResponsePlan:
        """The response plan: the prompt's one output, or with --sampling random at a temperature
        above 0 (unset is SGLang's 1.0) one drawn at random; a continuation (`so_far`: the ids
        it has) goes on with the output they began, on whichever server, as a model conditions
        on what it has said."""
        config = self.config
        salt = None
        if config.sampling == "random" and not (isinstance(temperature, (int, float))
                                                and temperature == 0):
            salt = lengths.salt_of(so_far) if so_far else None
            if salt is None:
                known = [i for i in so_far if i < tokens.VOCAB][:1]  # cut after its first word
                salt = (known[0] if known else self._sampler.randrange(tokens.VOCAB)) \
                    + tokens.VOCAB * self._sampler.randrange(tokens.VOCAB)
        return lengths.plan_response(prompt_ids, thinking, median=config.median_tokens,
                                     p_over_4096=config.p_over_4096,
                                     fixed_tokens=config.fixed_tokens,
                                     byte_level=self.byte_level, salt=salt,
                                     loop_share=config.loop_share)

    def _generate_body(self, gen: Generation, outcome: str, _params: None) -> dict:
        layout, n, start = gen.plan.layout, gen.completion, gen.start
        now = time.time()
        if outcome == "abort_waiting":
            finish: dict = {"type": "abort", "message": "Abort in waiting queue"}
        elif outcome == "abort":
            finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        elif gen.finish == "stop":
            finish = {"type": "stop", "matched": tokens.IM_END}
        else:
            finish = {"type": "length", "length": n}
        started = gen.started or now
        first_token = started + gen.prefill_s
        decode_s = max(1e-9, now - first_token)
        return {
            # Decoded from this request's own ids alone (tokens.py): joined with another
            # request's text it is not the text of their ids joined (/v1/detokenize is).
            "text": layout.text(start, start + n),
            "output_ids": layout.ids(start, start + n),
            "meta_info": {
                "id": gen.rid, "finish_reason": finish, "prompt_tokens": gen.input_tokens,
                "weight_version": "default", "num_retractions": 0,
                "storage_prefetch_wait": 0.0, "storage_staging_wait": 0.0,
                "forward_entry_time": started, "prefill_finished_time": first_token,
                "queue_time": started - gen.arrived, "reasoning_tokens": 0, "completion_tokens": n,
                "cached_tokens": gen.cached,
                "weight_versions": [{"version": "default", "start": 0, "end": n}],
                "cached_tokens_details": {"device": gen.cached, "host": 0} if gen.cached else None,
                "dp_rank": None, "e2e_latency": now - gen.arrived, "request_received_ts": gen.arrived,
                "first_token_latency": first_token - gen.arrived,
                "api_server_dispatch_finish_ts": gen.arrived, "request_finished_ts": now,
                "decode_throughput": n / decode_s if n else 0.0,
                "response_sent_to_client_ts": now,
            },
        }

    def _note_sampling(self, endpoint: str, rid: Any, given: dict, defaults: dict | None) -> None:
        """The parameters the request samples with: those it gives, then (the chat endpoint
        only, as SGLang's `--sampling-defaults model`) the model's defaults, then SGLang's."""
        effective = {**SGLANG_SAMPLING_DEFAULTS, **(defaults or {}),
                     **{k: given[k] for k in SGLANG_SAMPLING_DEFAULTS if given.get(k) is not None}}
        self.sampling_seen.append({"endpoint": endpoint, "rid": rid, "sampling": effective,
                                   "seed": given.get("seed" if endpoint == "chat" else "sampling_seed")})

    async def sim_sampling(self, request: web.Request) -> web.Response:
        return _json(list(self.sampling_seen))

    async def detokenize(self, request: web.Request) -> web.Response:
        """SGLang 0.5.23's /v1/detokenize: {model, tokens, skip_special_tokens} -> {text}."""
        try:
            data = json.loads(await request.read() or b"{}")
            ids = data["tokens"]
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise ValueError("tokens must be a list of token ids")
        except (ValueError, KeyError, TypeError) as exc:
            return _json(openai_error(400, f"Invalid request: {exc}", "BadRequestError"), 400)
        text = tokens.decode(ids, byte_level=self.byte_level,
                             skip_special=data.get("skip_special_tokens", True) is not False)
        return _json({"text": text})

    async def tokenize(self, request: web.Request) -> web.Response:
        """SGLang 0.5.23's /v1/tokenize for one prompt string: {tokens, count, max_model_len}."""
        try:
            data = json.loads(await request.read() or b"{}")
            prompt = data["prompt"]
            if not isinstance(prompt, str):
                raise ValueError("the simulated server tokenizes one prompt string")
        except (ValueError, KeyError, TypeError) as exc:
            return _json(openai_error(400, f"Invalid request: {exc}", "BadRequestError"), 400)
        ids = tokens.encode(prompt)
        return _json({"tokens": ids, "count": len(ids), "max_model_len": self.config.context_length})

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            data = json.loads(await request.read() or b"{}")
        except ValueError:
            data = {}
        rid = data.get("rid") if isinstance(data, dict) else None
        abort_all = bool(data.get("abort_all")) if isinstance(data, dict) else False
        rid = rid if isinstance(rid, str) else ""
        self._abort(rid, abort_all or rid == "")
        return web.Response(status=200)

    # ------------------------------------------------------------------ information endpoints

    async def health(self, request: web.Request) -> web.Response:
        now = time.time()
        if now < self.up_at or now < self.down_until:
            return web.Response(status=503)
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        name = self.config.model_name
        return _json({"object": "list", "data": [{
            "id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang",
            "root": name, "parent": None, "max_model_len": self.config.context_length}]})

    def _model_info(self) -> dict:
        name = self.config.model_name
        return {"model_path": name, "served_model_name": name, "tokenizer_path": name,
                "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
                "load_format": "auto", "reasoning_parser": self.config.reasoning_parser,
                "tool_call_parser": None,
                "disaggregation_mode": "null", "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": "qwen3",
                "architectures": ["Qwen3ForCausalLM"]}

    async def model_info(self, request: web.Request) -> web.Response:
        return _json(self._model_info())

    async def server_info(self, request: web.Request) -> web.Response:
        c = self.config
        return _json({
            "model_path": c.model_name, "tokenizer_path": c.model_name, "served_model_name": c.model_name,
            "host": c.host, "port": self.port, "context_length": c.context_length,
            "max_running_requests": c.slots, "max_queued_requests": c.max_queued or None,
            "max_total_tokens": self.max_total_num_tokens, "revision": None,
            "chat_template": c.chat_template, "reasoning_parser": c.reasoning_parser,
            "enable_metrics": True, "tp_size": 1, "dp_size": 1, "random_seed": c.seed,
            "status": "ready" if time.time() >= self.up_at else "starting",
            "internal_states": [{"last_gen_throughput": self._gen_throughput(),
                                 "memory_usage": {}, "avg_spec_accept_length": None}],
            "version": VERSION,
        })

    def _gen_throughput(self) -> float:
        return sum((1.0 / j.token_s for j in self.running if j.token_s > 0), 0.0)

    def _used_tokens(self) -> int:
        now = time.time()
        return sum(j.input_tokens + j.decoded(now) for j in self.running)

    async def loads(self, request: web.Request) -> web.Response:
        running, waiting = len(self.running), len(self.waiting)
        used = self._used_tokens()
        pending = sum(j.input_tokens for j in self.waiting)
        cap = self.max_total_num_tokens
        token_usage = used / cap
        throughput = self._gen_throughput()
        utilization = running / self.config.slots
        now = time.time()
        rank = {"dp_rank": 0, "timestamp": now, "num_running_reqs": running,
                "num_waiting_reqs": waiting, "num_used_tokens": used, "num_total_tokens": used + pending,
                "max_total_num_tokens": cap, "token_usage": token_usage, "gen_throughput": throughput,
                "cache_hit_rate": self._cache_hit_rate(), "utilization": utilization,
                "max_running_requests": self.config.slots}
        rank = {k: v for k, v in rank.items() if v}  # msgspec omit_defaults: zeros are left out
        rank["num_total_reqs"] = running + waiting
        return _json({
            "timestamp": datetime.now(timezone.utc).isoformat(), "version": VERSION, "dp_rank_count": 1,
            "loads": [rank],
            "aggregate": {"total_running_reqs": running, "total_waiting_reqs": waiting,
                          "total_reqs": running + waiting, "total_used_tokens": used,
                          "total_tokens": used + pending, "avg_token_usage": token_usage,
                          "avg_throughput": throughput, "avg_utilization": utilization},
        })

    def _cache_hit_rate(self) -> float:
        return self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0

    async def metrics(self, request: web.Request) -> web.Response:
        name = self.config.model_name
        gauge_labels = (f'{{engine_type="unified",model_name="{name}",moe_ep_rank="0",'
                        f'pp_rank="0",tp_rank="0"}}')
        counter_labels = f'{{engine_type="unified",is_streaming="false",model_name="{name}"}}'
        used = self._used_tokens()
        lines: list[str] = []

        def family(metric: str, kind: str, help_text: str, samples: list[tuple[str, str, float]]):
            lines.append(f"# HELP sglang:{metric} {help_text}")
            lines.append(f"# TYPE sglang:{metric} {kind}")
            for suffix, labels, value in samples:
                lines.append(f"sglang:{metric}{suffix}{labels} {float(value)!r}")

        def gauge(metric: str, help_text: str, value: float):
            family(metric, "gauge", help_text, [("", gauge_labels, value)])

        def counter(metric: str, help_text: str, value: float):
            family(metric, "counter", help_text, [("", counter_labels, value)])

        gauge("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.",
              self.max_total_num_tokens)
        gauge("context_len", "Maximum context length.", self.config.context_length)
        gauge("num_running_reqs", "The number of running requests.", len(self.running))
        gauge("num_queue_reqs", "The number of requests in the waiting queue.", len(self.waiting))
        gauge("gen_throughput", "The generation throughput (token/s).", self._gen_throughput())
        gauge("cache_hit_rate", "The prefix cache hit rate.", self._cache_hit_rate())
        gauge("token_usage", "The token usage.", used / self.max_total_num_tokens)
        gauge("num_used_tokens", "The number of used tokens.", used)
        gauge("utilization", "The utilization.", len(self.running) / self.config.slots)
        counter("prompt_tokens_total", "Number of prefill tokens processed.", self.prompt_tokens_total)
        counter("generation_tokens_total", "Number of generation tokens processed.",
                self.generation_tokens_total)
        counter("num_requests_total", "Number of requests processed.", self.finished_requests)
        family("cached_tokens_total", "counter",
               "Number of cached prompt tokens by source (device/host/storage).",
               [("", f'{{cache_source="device",engine_type="unified",model_name="{name}"}}',
                 self.cached_tokens_total)])
        histogram = [("_sum", counter_labels, self._latency_sum)]
        cumulative = 0
        for le, count in zip([*_LATENCY_BUCKETS, math.inf], self._latency_counts):
            cumulative += count
            le_text = "+Inf" if le == math.inf else repr(le)
            histogram.append(("_bucket", f'{{engine_type="unified",is_streaming="false",le="{le_text}",'
                                         f'model_name="{name}"}}', cumulative))
        histogram.append(("_count", counter_labels, cumulative))
        family("e2e_request_latency_seconds", "histogram",
               "Histogram of End-to-end request latency in seconds", histogram)
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")

    # ------------------------------------------------------------------ /sim control endpoints

    def stats(self) -> dict:
        now = time.time()
        return {
            "requests": self.requests,
            "by_endpoint": dict(self.by_endpoint),
            "completed": dict(self.completed),
            "errors": dict(self.errors),
            "running": len(self.running),
            "queued": len(self.waiting),
            "held": self.held,
            "slots": self.config.slots,
            "max_running_seen": self.max_running_seen,
            "max_queued_seen": self.max_queued_seen,
            "busy_slot_seconds": self.busy_slot_seconds,
            # busy_slot_seconds counts a request when it ends; this adds the running ones so far
            "busy_slot_seconds_live": self.busy_slot_seconds + sum(
                now - gen.started for gen in self.running),
            "service_seconds_sum": self.service_seconds_sum,
            "queue_seconds_sum": self.queue_seconds_sum,
            "prompt_tokens": self.prompt_tokens_total,
            "completion_tokens": self.generation_tokens_total,
            "cached_tokens": self.cached_tokens_total,
            "started_at": self.started_at,
            "first_request_at": self.first_request_at,
            "last_finished_at": self.last_finished_at,
            "last_started_at": self.last_started_at,
            "now": now,
            "down_count": self.down_count,
            "faults": dict(self.faults),
            "config": asdict(self.config),
        }

    async def sim_stats(self, request: web.Request) -> web.Response:
        return _json(self.stats())

    async def sim_faults(self, request: web.Request) -> web.Response:
        try:
            data = json.loads(await request.read())
            if not isinstance(data, dict):
                raise ValueError("expected a JSON object")
            update = {}
            for key, value in data.items():
                if key not in self.faults:
                    raise ValueError(f"unknown fault {key!r}; known: {sorted(self.faults)}")
                value = float(value)
                if key == "slow_factor" and not value > 0:
                    raise ValueError("slow_factor must be positive")
                if key != "slow_factor" and not 0.0 <= value <= 1.0:
                    raise ValueError(f"{key} must be a probability")
                update[key] = value
        except (ValueError, TypeError) as exc:
            return _json({"error": str(exc)}, 400)
        self.faults.update(update)
        return _json(self.faults)

    async def sim_hold(self, request: web.Request) -> web.Response:
        try:
            after = int(json.loads(await request.read() or b"{}").get("after") or 0)
        except (ValueError, TypeError, AttributeError):
            return _json({"error": 'expected {"after": N} or nothing'}, 400)
        if self.answering is None:
            self.answering = asyncio.Event()
        if after > 0:
            self.answering.set()
            self.hold_after = after
        else:
            self.answering.clear()
        return _json({"held": not after, "after": after})

    async def sim_release(self, request: web.Request) -> web.Response:
        self.hold_after = None
        if self.answering is not None:
            self.answering.set()
        return _json({"held": False})

    async def sim_down(self, request: web.Request) -> web.StreamResponse:
        try:
            seconds = float(json.loads(await request.read() or b"{}").get("seconds", 5.0))
        except (ValueError, TypeError, AttributeError):
            return _json({"error": 'expected {"seconds": S}'}, 400)
        response = _json({"down_for": seconds})
        await response.prepare(request)
        await response.write_eof()  # answered before the socket goes away
        self._spawn(self.go_down(seconds, delay=0.05))
        return response


# ---------------------------------------------------------------------- request validation


def _load_json(raw: bytes, path: str, func: str) -> dict:
    try:
        data = json.loads(raw)
    except ValueError:
        raise _validation_error("json_invalid", ("body", 0), "JSON decode error", raw[:40].decode(errors="replace"),
                                path, func) from None
    if not isinstance(data, dict):
        raise _validation_error("model_attributes_type", ("body",),
                                "Input should be a valid dictionary or object to extract fields from",
                                data, path, func)
    return data


def _validation_error(err_type: str, loc: tuple, msg: str, value: Any, path: str, func: str) -> BadRequest:
    """A 400 shaped like SGLang's answer to a request its pydantic model rejects."""
    err = {"type": err_type, "loc": loc, "msg": msg, "input": value}
    message = (f"1 validation error:\n  {err!r}\n\n  File \"sglang/srt/entrypoints/http_server.py\", "
               f"in {func}\n    POST {path} [{err!r}]")
    return BadRequest(400, openai_error(400, message, "Bad Generation"))


def _native_error(message: str) -> BadRequest:
    """A 400 shaped like SGLang's /generate answer to a ValueError."""
    return BadRequest(400, {"error": {"message": message}})


# SGLang's own defaults for what `--sampling-defaults model` may take from generation_config.json.
SGLANG_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                            "repetition_penalty": 1.0}


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """SGLang 0.5.23's qwen3 reasoning parser on a whole, non-streamed text (its
    `BaseReasoningFormatDetector._detect_and_parse_impl`): thinking on forces reasoning up to
    `</think>`, leading `<think>` tags dropped, nothing stripped; an empty reasoning is null."""
    if not thinking and "<think>" not in text:
        return None, text
    while text.startswith("<think>"):
        text = text[len("<think>"):]
    if "</think>" not in text:
        tool = text.find("<tool_call>")
        if tool != -1:
            return text[:tool] or None, text[tool:]
        return text or None, ""
    reasoning, answer = text.split("</think>", 1)
    return reasoning or None, answer


def _check_sampling(params: dict, native: bool = False) -> None:
    """SGLang's sampling-parameter checks, for the parameters the simulation reads."""
    message = None
    temperature, top_p, top_k = params.get("temperature"), params.get("top_p"), params.get("top_k")
    if temperature is not None:
        numeric = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
        if not numeric or not math.isfinite(temperature) or temperature < 0:
            shown = float(temperature) if numeric else temperature
            message = f"temperature must be a non-negative finite number, got {shown!r}."
    if message is None and top_p is not None and not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        message = f"top_p must be in (0, 1], got {top_p!r}."
    if message is None and top_k is not None and not (isinstance(top_k, int) and (top_k == -1 or top_k >= 1)):
        message = f"top_k must be -1 (disable), or at least 1, got {top_k!r}."
    if message is not None:
        raise _native_error(message) if native else BadRequest(400, openai_error(400, message, "BadRequestError"))


def _check_context(input_tokens: int, max_new: int | None, context_length: int, openai: bool) -> int:
    """The completion budget, or SGLang's 400 when the request cannot fit the context."""
    if input_tokens >= context_length:
        # SGLang 0.5.23's tokenizer manager, on both endpoints (its scheduler's "Input length
        # (...) exceeds the maximum allowed length" is reached only by inputs within 6 tokens).
        message = (f"The input ({input_tokens} tokens) is longer than the model's context length "
                   f"({context_length} tokens).")
    elif max_new is not None and input_tokens + max_new > context_length:
        message = (f"Requested token count exceeds the model's maximum context length of {context_length} "
                   f"tokens. You requested a total of {input_tokens + max_new} tokens: {input_tokens} tokens "
                   f"from the input messages and {max_new} tokens for the completion. Please reduce the "
                   f"number of tokens in the input messages or the completion to fit within the limit.")
    else:
        return context_length - input_tokens if max_new is None else max_new
    raise BadRequest(400, openai_error(400, message, "BadRequestError") if openai else {"error": {"message": message}})


# ---------------------------------------------------------------------- running it


async def serve(config: SimConfig) -> None:
    """Run until SIGTERM or SIGINT."""
    sim = SimServer(config)
    await sim.start()
    print(f"sim-server listening on http://{config.host}:{sim.port} (slots={config.slots})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await sim.close()


def run(config: SimConfig) -> None:
    asyncio.run(serve(config))
