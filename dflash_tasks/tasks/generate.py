"""The prompt task: one prompt, one SGLang request, one ledger entry, then refill the window.

What each failure does (docs/WHEN_THINGS_FAIL.md has the operator's side):

- transient (`sglang.TransientError`: refused/reset connections, timeouts, 429/5xx, a body that
  is not SGLang's JSON, an aborted request): retried with exponential backoff and full jitter, on
  the same GPU's queue, up to `max_retries` attempts; then the prompt goes to the failed registry
  with its last error (class "transient": `retry-failed` brings it back);
- permanent (`sglang.PermanentError`: HTTP 400 such as a prompt longer than the context, 404,
  a 200 without choices): straight to the failed registry with the server's message;
- the server stops answering: the worker's circuit breaker (worker/breaker.py) opens, and tasks wait
  *before* sending their request, so they spend no attempt; after `breaker_wait_s` a task puts
  its prompt back in the queue and frees its thread;
- the prompt's body cannot be read (kept on the output storage by `enqueue --bodies storage`):
  S3 out, retried with backoff without spending an attempt, since nothing was sent; its chunk
  gone or cut short, straight to the failed registry ("prompt_body_missing"); this node refused
  (credentials), the GPU stops as for a misconfigured server (`_read_body`);
- the server is not the SGLang it should be (sglang.DeploymentError: a 404 on its endpoints,
  401/403, another model): the deployment's fault, no attempt spent, the GPU's breaker opens at
  once and beat hands its prompts to the other GPUs;
- Redis goes away mid-task (a restart): ledger writes are retried for `redis_outage_s`; every
  write is idempotent per prompt id, so a write that succeeded before the reply was lost is not
  counted twice;
- warm shutdown (shutdown.py): a prompt not sent yet goes back to its queue at once, a request in
  flight gets `shutdown_grace_s` (0 by default), then is aborted, and what it had generated goes
  back to pending with the prompt, to be continued on another GPU (`_hand_over`);
- the end game: a generation on a GPU measurably slower than one with a free slot, once nothing
  else waits, is aborted here and continued there from its exact tokens (`_hand_over`); and
  near the end a request runs one round at most (dispatch/window.py's round_cap), and one cut
  there goes on from its exact tokens in a later round (`_next_round`).

`attempts` counts requests actually sent for the prompt in this round; it travels in the task's
kwargs (`tries` = failed requests so far), not in Celery's retry count, which also counts the
hand-backs that sent nothing.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from functools import partial
from typing import Callable, TypeVar

from celery.exceptions import Reject, Retry

from dflash_tasks.core.connections import REDIS_DOWN, through_outage
from dflash_tasks.core.jobs import GenerationParams
from dflash_tasks.core.keys import GENERATE_TASK, GpuName, JobName
from dflash_tasks.core.settings import get_settings
from dflash_tasks.dispatch import publish, topup, window
from dflash_tasks.dispatch.retry import RetryPolicy
from dflash_tasks.ledger import TaskState, bodies
from dflash_tasks.ledger.messages import compress_messages_json, decode_messages
from dflash_tasks.output.rows import build_row
from dflash_tasks.output.storage import (
    StorageCorrupt,
    StorageDenied,
    StorageError,
    StorageNotFound,
    storage_at,
)
from dflash_tasks.sglang import (
    BadResponse,
    Completion,
    DeploymentError,
    InvalidRequest,
    PermanentError,
    RequestAborted,
    SGLangClient,
    SGLangError,
    TransientError,
)
from dflash_tasks.sglang.continuation import continue_generation, entry_from_partial
from dflash_tasks.tasks.app import app
from dflash_tasks.worker.breaker import TRANSIENT
from dflash_tasks.worker.runtime import runtime

log = logging.getLogger(__name__)
T = TypeVar("T")


class PromptFailed(Exception):
    """Raised after a prompt was entered in the failed registry, so Flower lists the task as
    FAILURE with the reason; declared in `throws`, so Celery logs it without a traceback."""


def durable(what: str, fn: Callable[..., T], *args, **kwargs) -> T:
    """A ledger write or read that waits out a Redis restart (`redis_outage_s`)."""
    return through_outage(what, get_settings().redis_outage_s, fn, *args, **kwargs)


# No stored result: the ledger holds every outcome (rows, counters, the failed registry), and
# Flower sees each task's result in its events; storing it cost a GPU worker a SETEX and a PUBLISH
# per completion (benchmarks/RESULTS.md, case 4: the profile's "result backend").
@app.task(name=GENERATE_TASK, bind=True, max_retries=None, throws=(PromptFailed,), ignore_result=True)
def generate(self, job: str, prompt_id: str, gpu: str, tries: int = 0) -> dict:
    job, gpu = JobName(job), GpuName(gpu)  # the message's: checked here, once
    try:
        return _generate(self, job, prompt_id, gpu, tries)
    except (Retry, Reject, PromptFailed, *REDIS_DOWN):
        raise
    except Exception as exc:
        # A bug, not an answer of the server: park the prompt in the registry (with the error)
        # instead of letting the reaper send it again and again.
        log.exception("prompt %s on %s: unexpected error", prompt_id, gpu)
        _record_failure(job, prompt_id, gpu, reason="internal_error", klass="permanent",
                        error=f"{type(exc).__name__}: {exc}", status=None, attempts=tries + 1)
    finally:
        _refill(job, gpu)


def _generate(self, job: JobName, prompt_id: str, gpu: GpuName, tries: int) -> dict:
    book = runtime().book
    shutdown = runtime().shutdown
    if shutdown.requested():
        raise Reject("worker shutting down: prompt returned to its queue", requeue=True)
    state = durable("reading the prompt", book.task_state, job, prompt_id, gpu)
    runtime().settings.failpoint("generate.after_read")
    # An outcome already there: the prompt leaves this GPU's in-flight set, unless it came back
    # and was dispatched here again since the read (drop_settled checks in the same step).
    if state.done:
        window.drop_settled(book.r, job, gpu, prompt_id)
        return {"id": prompt_id, "skipped": "already done"}
    if state.failed:
        window.drop_settled(book.r, job, gpu, prompt_id)
        return {"id": prompt_id, "skipped": "in the failed registry (see retry-failed)"}
    if not state.stored or state.params is None:
        window.drop_settled(book.r, job, gpu, prompt_id)
        return {"id": prompt_id, "skipped": "not pending (job removed)"}
    if not state.in_flight_here:
        # Recalled from this GPU (a cancel, a GPU the job no longer uses, this worker given up
        # for gone) while the message waited: the prompt is pending again, or dispatched elsewhere.
        return {"id": prompt_id, "skipped": f"no longer dispatched to {gpu}"}
    if state.messages is None:
        decoded = _read_body(self, job, prompt_id, gpu, tries, state)
        if decoded is None:
            return {"id": prompt_id, "skipped": "done by another delivery, or its job deleted"}
        state = state.with_body(decoded)
    messages = state.messages
    params = GenerationParams.from_dict(state.params)
    s = get_settings()
    client = runtime().client(gpu)
    circuit = runtime().breaker(gpu)
    was_open = not circuit.closed
    if not circuit.wait_closed(s.breaker_wait_s):
        # Nothing was sent: the prompt goes back to the queue with its attempts unspent, and
        # this thread is free (the visibility timeout never runs out on a waiting message).
        why = "worker shutting down" if shutdown.requested() else \
            f"server unavailable for {s.breaker_wait_s:.0f}s (circuit open)"
        raise Reject(f"{why}: prompt returned to its queue", requeue=True)
    if was_open and not durable("reading the prompt", book.task_state, job, prompt_id,
                                gpu).in_flight_here:
        # While this waited, beat handed the GPU's prompts to the others (a breaker open long).
        return {"id": prompt_id, "skipped": f"handed to another GPU while {gpu} was unavailable"}

    attempt = tries + 1
    # Unique per request (SGLang keys its running requests by rid), so a stray second delivery
    # never collides with the first; `abort` uses the exact rid.
    rid = f"{job}:{prompt_id}:{attempt}:{uuid.uuid4().hex[:12]}"
    # regenerate --continue, a move, a round: only the missing tokens; unless the cap was lowered
    # since to what the output already has, and it is generated anew at the job's cap
    cont = state.continuation
    continuing = cont is not None and len(cont["response_ids"]) < params.max_tokens
    try:
        cap = window.round_cap(
            s, params.max_tokens, len(cont["response_ids"]) if continuing else 0, state.pending,
            (runtime().concurrency or s.default_concurrency) * max(1, state.job_gpus),
            overflows=continuing and _overflows(client, len(cont["prompt_ids"]), params))
        server = client.contract()  # learnt at the worker's start (hooks.py), then cached
        with shutdown.tracked(rid, lambda: client.abort(rid)):
            if continuing:
                completion = continue_generation(client, cont, params, rid, until=cap)
            else:
                completion = client.chat(messages, max_tokens=cap,
                                         temperature=params.temperature, top_p=params.top_p,
                                         top_k=params.top_k,
                                         enable_thinking=params.enable_thinking, rid=rid)
        # Cut at the end of its round, it goes on in the next. So does one whose prompt and the
        # job's cap overflow the context: the next request asks for the whole cap, which the
        # server refuses in its own words, as it would have the first without rounds.
        next_round = cap < params.max_tokens and (
            completion.finish_reason == "length"
            or _overflows(client, completion.prompt_tokens, params))
        if next_round and completion.response_token_ids is None:
            raise BadResponse("cut at the end of its round without the token ids to go on from"
                              " (return_token_ids)", url=client.base_url)
    except TransientError as exc:
        if isinstance(exc, RequestAborted) and exc.partial is not None and \
                (moved := _hand_over(job, prompt_id, gpu, messages, exc.partial, params,
                                     _kept_reference(state))):
            return moved
        if exc.reason == "timeout":
            client.abort(rid)  # or the server keeps decoding for nobody
        if shutdown.requested():
            raise Reject(f"worker shutting down ({exc.reason}): prompt returned to its queue",
                         requeue=True) from None
        circuit.record_failure(str(exc))
        policy = RetryPolicy.from_settings(s)
        if policy.retries(attempt):
            countdown = policy.backoff_s(tries)
            if not durable("counting a retry", book.note_retry, job, prompt_id, gpu, exc.reason,
                           time.time() + countdown):
                return {"id": prompt_id, "skipped": "done by another delivery, or its job deleted"}
            log.info("prompt %s on %s: %s; retry %d/%d in %.1fs", prompt_id, gpu, exc,
                     attempt, s.max_retries, countdown)
            raise self.retry(exc=exc, countdown=countdown, queue=gpu,
                             args=(job, prompt_id, gpu), kwargs={"tries": attempt})
        _fail(job, prompt_id, gpu, exc, attempt)
    except DeploymentError as exc:
        # Not the prompt's fault: no attempt spent, no failure recorded. The GPU stops taking
        # work at once and beat hands its prompts to the job's other GPUs (breaker.py).
        circuit.trip(exc.reason, str(exc), client.identity_ok)
        raise Reject(f"{gpu}: {exc}: prompt returned to its queue", requeue=True) from None
    except PermanentError as exc:
        if isinstance(exc, InvalidRequest) and exc.context_too_long:
            circuit.record_success()  # the server answered, about this prompt at this cap
        else:  # answered, but the same answer to every request is the server's (breaker.py)
            circuit.record_permanent(exc.reason, str(exc))
        _fail(job, prompt_id, gpu, exc, attempt)
    circuit.record_success()
    if next_round:
        return _next_round(job, prompt_id, gpu, messages, completion, params,
                           _kept_reference(state))
    row = build_row(prompt_id, messages, completion, job=job, gpu=gpu, params=params,
                    attempts=attempt, server=server)
    recorded = durable("recording the row",
                       lambda: book.complete(job, prompt_id, gpu, row,
                                             bare_entry=state.bare_entry))
    return {"id": prompt_id, "finish_reason": completion.finish_reason,
            "completion_tokens": completion.completion_tokens, "attempts": attempt,
            **({} if recorded else {"skipped": "duplicate delivery"})}


def _read_body(task, job: JobName, prompt_id: str, gpu: GpuName, tries: int,
               state) -> list | dict | None:
    """The entry of a prompt whose body is kept on storage (ledger/bodies.py: its messages, or
    those of a truncated row to continue with what the continuation needs), by fault:
    - the storage out (S3 unreachable, a slow disk): waited out like a server that does not
      answer, nothing was sent so the retry spends no attempt; once the outage has lasted
      breaker_wait_s the GPU's breaker opens and says so (status), until a read works again;
    - the chunk gone, or shorter than its reference: the prompt fails at once
      (prompt_body_missing), since waiting will not bring it back;
    - this node refused (no credentials, access denied): the deployment's fault, so the GPU
      stops taking work and its prompts go elsewhere, like a misconfigured server."""
    outage = runtime().prompt_storage
    try:
        if state.body_location is None:
            raise StorageNotFound(f"job {job} records no location for its prompt bodies")
        storage = storage_at(state.body_location, get_settings(), readers=runtime().pool_size())
        frame = bodies.read_frame(storage, job, state.body_reference)
    except (StorageNotFound, StorageCorrupt) as exc:
        _record_failure(job, prompt_id, gpu, reason="prompt_body_missing", klass="permanent",
                        error=str(exc), status=None, attempts=tries)
    except StorageDenied as exc:
        runtime().breaker(gpu).trip("prompt_storage_denied", str(exc),
                                    partial(_readable, storage, job, state.body_reference))
        raise Reject(f"{gpu}: {exc}: prompt returned to its queue", requeue=True) from None
    except StorageError as exc:
        policy = RetryPolicy.from_settings(get_settings())
        countdown = policy.backoff_s(min(task.request.retries, 10))
        if not durable("counting a retry", runtime().book.note_retry, job, prompt_id, gpu,
                       "prompt_storage", time.time() + countdown):
            return None
        # One warning per outage, not one per thread and retry (the rest at DEBUG).
        log.log(logging.WARNING if outage.failed() else logging.DEBUG,
                "prompt %s on %s: cannot read its text (%s); again in %.1fs, no attempt spent "
                "(prompts wait until the storage answers)", prompt_id, gpu, exc, countdown)
        if (lasted := outage.lasted_s()) >= get_settings().breaker_wait_s:
            runtime().breaker(gpu).trip(
                "prompt_storage", f"prompt texts unreadable for {lasted:.0f}s: {exc}",
                partial(_readable, storage, job, state.body_reference), kind=TRANSIENT)
        raise task.retry(exc=exc, countdown=countdown, queue=gpu,
                         args=(job, prompt_id, gpu), kwargs={"tries": tries})
    if (ended := outage.succeeded()) is not None:
        log.warning("prompt texts readable again after %.0fs (%d reads failed meanwhile)",
                    ended[1], ended[0])
    return decode_messages(frame)


def _readable(storage, job: JobName, reference: bytes) -> bool:
    """The breaker's probe while prompt texts cannot be read: one read of a prompt's bytes."""
    try:
        bodies.read_frame(storage, job, reference)
        return True
    except StorageError:
        return False


def _kept_reference(state: TaskState) -> bytes | None:
    """The reference of a prompt whose text is on storage, kept by the entry of a generation
    moved or between rounds: only the prompt's own (not that of a regenerated entry's chunk)."""
    bare = state.bare_entry
    return bare if bare is not None and bodies.is_reference(bare) else None


def _going_on(messages: list[dict], partial: Completion, gpu: GpuName, params: GenerationParams,
              body_reference: bytes | None) -> tuple[bytes, int]:
    """The prompt entry that goes on from a generation stopped on `gpu` (moved, or cut at its
    round's end), as stored, and the tokens it made here."""
    entry = entry_from_partial(messages, partial, gpu, params.enable_thinking, body_reference)
    frame = compress_messages_json(json.dumps(entry, separators=(",", ":")).encode())
    return frame, partial.completion_tokens - partial.continued_tokens


def _hand_over(job: JobName, prompt_id: str, gpu: GpuName, messages: list[dict], partial,
               params: GenerationParams, body_reference: bytes | None) -> dict | None:
    """A generation aborted here with its partial output, to go on elsewhere from its exact
    tokens: ordered moved to a faster GPU at the end of the run (take.lua, worker/migration.py),
    or this worker is stopping (then back to the front of pending, for the job's other GPUs).
    Its entry becomes the one that continues it, and the prompt moves there (hand_over.lua); the
    row made there counts each token once and names every GPU that worked on it. None when the
    abort was neither (it is retried as before)."""
    book, stopping = runtime().book, runtime().shutdown.requested()
    target = None if stopping else window.migration_target(book.r, job, prompt_id, gpu)
    if target is None and not stopping:
        return None
    frame, tokens = _going_on(messages, partial, gpu, params, body_reference)
    if not durable("handing the generation over", window.hand_over, book.r, job, prompt_id, gpu,
                   target, frame, tokens):
        return {"id": prompt_id, "skipped": "no longer in flight here: not handed over"}
    runtime().settings.failpoint("generate.after_hand_over")
    if target is not None:
        publish(app, job, target, [prompt_id])
    log.info("prompt %s: %d tokens generated on %s, continued on %s", prompt_id, tokens, gpu,
             target or "another GPU (this worker stops)")
    return {"id": prompt_id, "moved_to": target or "pending", "tokens": tokens}


def _overflows(client: SGLangClient, prompt_tokens: int, params: GenerationParams) -> bool:
    """The prompt and the job's cap exceed the model's context (the server's own check)."""
    context = client.context_length()
    return context is not None and prompt_tokens + params.max_tokens > context


def _next_round(job: JobName, prompt_id: str, gpu: GpuName, messages: list[dict],
                cut: Completion, params: GenerationParams, body_reference: bytes | None) -> dict:
    """A generation cut at its round's end (window.round_cap): to the back of pending with its
    exact tokens, for whichever GPU frees a slot to go on (next_round.lua)."""
    book = runtime().book
    frame, tokens = _going_on(messages, cut, gpu, params, body_reference)
    if not durable("handing the generation to its next round", window.next_round, book.r, job,
                   prompt_id, gpu, frame, tokens):
        return {"id": prompt_id, "skipped": "no longer in flight here: not handed on"}
    return {"id": prompt_id, "next_round": True, "tokens": tokens}


def _refill(job: JobName, gpu: GpuName) -> None:
    if runtime().shutdown.requested():
        return  # the next worker (or beat's maintain) refills; this one takes nothing new
    try:
        topup(app, runtime().book, runtime().settings, job, gpu, runtime().concurrency)
    except Exception as exc:  # Redis away: beat's maintain tops the window up within 10 s
        log.warning("%s: could not top up job %s's window (%s)", gpu, job, exc)


def _fail(job: JobName, prompt_id: str, gpu: GpuName, exc: SGLangError, attempts: int) -> None:
    _record_failure(job, prompt_id, gpu, reason=exc.reason,
                    klass="transient" if exc.transient else "permanent", error=str(exc),
                    status=exc.status, attempts=attempts)


def _record_failure(job: JobName, prompt_id: str, gpu: GpuName, *, reason: str, klass: str,
                    error: str, status: int | None, attempts: int) -> None:
    """Enter the prompt in the failed registry, then raise PromptFailed (Flower: FAILURE)."""
    record = {"id": prompt_id, "reason": reason, "class": klass, "error": error[:2000],
              "status": status, "attempts": attempts, "gpu": gpu, "at": round(time.time(), 3)}
    durable("recording a failure",
            lambda: runtime().book.fail(job, prompt_id, gpu, record))
    log.warning("prompt %s failed (%s, %s) on %s after %d attempt(s): %s", prompt_id, klass,
                reason, gpu, attempts, error[:500])
    raise PromptFailed(f"{reason}: {error[:500]}")
