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
  a storage fault is never the prompt's, so it spends no attempt and fails no prompt. S3 out,
  retried with backoff; its chunk not found on this node (a directory not mounted) or this node
  refused (credentials, permissions), the GPU stops as for a misconfigured server and the
  prompt waits for a GPU that can read it. A chunk that answers with bytes that are not the
  prompt's (cut short, not zstd, not JSON) fails it for good ("prompt_body_corrupt")
  (`_read_body`);
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
from functools import partial
from pathlib import Path
from typing import Callable, TypeVar

from celery.exceptions import Reject, Retry

from dflash_tasks.core import conversation, jobs
from dflash_tasks.core.connections import REDIS_DOWN, through_outage
from dflash_tasks.core.jobs import GenerationParams, JobDeleted
from dflash_tasks.core.keys import GENERATE_TASK, GpuName, JobName
from dflash_tasks.core.settings import get_settings
from dflash_tasks.dispatch import publish, topup, window
from dflash_tasks.dispatch.retry import RetryPolicy
from dflash_tasks.ledger import TaskState, bodies
from dflash_tasks.ledger.messages import compress_messages_json, encode_messages
from dflash_tasks.output.rows import build_conversation_row, build_row, turn_record
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
    Generation,
    InvalidRequest,
    PermanentError,
    RequestAborted,
    SGLangClient,
    SGLangError,
    TransientError,
    reasoning,
)
from dflash_tasks.sglang.ongoing import Ongoing, Part
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
            return {"id": prompt_id, "skipped": "its text not read: done or gone on by another "
                                                "delivery, handed to another GPU, or its job deleted"}
        state = state.with_body(decoded)
    messages = state.messages
    # A conversation's next reply is generated after its earlier ones (core/conversation.py).
    context = conversation.context(messages, [t["content"] for t in state.turns]) \
        if conversation.is_script(messages) else messages
    job_params = GenerationParams.from_dict(state.params)
    ongoing = _ongoing(state, job_params)
    params = ongoing.params if ongoing is not None else job_params
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
    rid = shutdown.request_id(job, prompt_id, attempt)
    try:
        server = client.contract()  # learnt at the worker's start (hooks.py), then cached
        if ongoing is not None and ongoing.finish_reason is not None:
            # Its ids are whole: only its text was left to decode when the server went away, or
            # it has the whole cap (_ongoing).
            return _record(job, prompt_id, gpu, state, messages, ongoing, client, server,
                           made=None)
        cap = _request_cap(client, server, state, ongoing, params)
        with shutdown.tracked(job, prompt_id, rid, lambda: client.abort(rid)):
            seed = jobs.request_seed(job, prompt_id, len(state.turns))
            if ongoing is not None:
                answer = ongoing.request(client, until=cap, rid=rid, seed=seed)
            else:
                answer = client.chat(context, max_tokens=cap, sampling=params.sampling(),
                                     enable_thinking=params.enable_thinking, rid=rid, seed=seed)
        # Cut at the end of its round, it goes on in the next. So does one whose prompt and the
        # job's cap overflow the context: the next request asks for the whole cap, which the
        # server refuses in its own words, as it would have the first without rounds.
        prompt_tokens = len(ongoing.prompt_ids) if ongoing is not None else answer.prompt_tokens
        next_round = cap < params.max_tokens and (
            answer.finish_reason == "length" or _overflows(client, prompt_tokens, params))
        if next_round and ongoing is None and answer.response_token_ids is None:
            raise BadResponse("cut at the end of its round without the token ids to go on from"
                              " (return_token_ids)", url=client.base_url)
    except TransientError as exc:
        if isinstance(exc, RequestAborted) and exc.partial is not None and \
                (moved := _hand_over(job, prompt_id, gpu, state, ongoing, params, exc.partial,
                                     attempt)):
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
    if ongoing is None and not next_round:  # one uninterrupted request: the server's own row
        return _complete(job, prompt_id, gpu, state, messages, answer, params, server,
                         attempts=attempt, made=(answer.completion_tokens, answer.latency_s))
    part = Part.of(answer)
    grown = (ongoing or Ongoing.started(answer, params)).went_on(part, gpu, attempt)
    if next_round:
        return _next_round(job, prompt_id, gpu, state, grown, part)
    return _record(job, prompt_id, gpu, state, messages, grown.ended(part), client, server,
                   made=part)


def _ongoing(state: TaskState, job_params: GenerationParams) -> Ongoing | None:
    """The generation this prompt goes on from (a round, a move, regenerate --continue), or None
    to start it. One that already has the job's whole cap and has not ended (a move whose
    abort came as it reached the cap, or a cap lowered since) ends at the cap, as one request
    capped there ends: its row is recorded from the ids it has."""
    if state.continuation is None:
        return None
    ongoing = Ongoing.from_entry(state.continuation, job_params)
    if ongoing.finish_reason is None and ongoing.generated >= ongoing.params.max_tokens:
        return ongoing.cut_at(ongoing.params.max_tokens)
    return ongoing


def _request_cap(client: SGLangClient, server, state: TaskState, ongoing: Ongoing | None,
                 params: GenerationParams) -> int:
    """How many output tokens in all this request may reach: the cap, or near the end of the
    job one round further (window.round_cap). A generation that could not go on exactly (a
    penalised one, a reasoning parser not reproduced: ongoing.py) is never cut."""
    if not (params.continuable and reasoning.supported(server.reasoning_parser)):
        return params.max_tokens
    return window.round_cap(
        get_settings(), params.max_tokens, ongoing.generated if ongoing is not None else 0,
        state.pending, _slots(state),
        overflows=ongoing is not None and _overflows(client, len(ongoing.prompt_ids), params))


def _slots(state: TaskState) -> int:
    """The requests the job's GPUs run at once (read with the prompt): whether it is in the end
    game's rounds (window.in_rounds)."""
    return (runtime().concurrency or get_settings().default_concurrency) * max(1, state.job_gpus)


def _record(job: JobName, prompt_id: str, gpu: GpuName, state: TaskState, messages: list[dict],
            ended: Ongoing, client: SGLangClient, server, *, made: Part | None) -> dict:
    """A generation that went on from its ids, ended: its row, its text decoded from all its ids
    by the server. A server gone between its answer and the decoding loses nothing: the whole
    ids go back to pending, and whichever GPU takes them decodes and records them."""
    try:
        completion = ended.finished(client, reasoning_parser=server.reasoning_parser)
    except SGLangError as exc:
        log.warning("prompt %s on %s: its %d tokens could not be decoded (%s): handed on whole",
                    prompt_id, gpu, ended.generated, exc)
        return _next_round(job, prompt_id, gpu, state, ended, made)
    return _complete(job, prompt_id, gpu, state, messages, completion, ended.params, server,
                     attempts=ended.attempts,
                     made=(len(made.ids), made.latency_s) if made is not None else (0, 0.0))


def _complete(job: JobName, prompt_id: str, gpu: GpuName, state: TaskState, messages: list[dict],
              completion: Completion, params: GenerationParams, server, *, attempts: int,
              made: tuple[int, float]) -> dict:
    """Record the row once; `made`: the tokens this request generated here and its seconds
    (this GPU's speed and rate). A conversation's reply that is not its last goes on to the next
    (_next_turn); its row, once every reply is made or one is cut at the cap, holds them all."""
    bare_entry = state.bare_entry
    if conversation.is_script(messages):
        turns = [*state.turns, turn_record(completion, gpu=gpu, attempts=attempts)]
        if completion.finish_reason == "stop" and len(turns) < conversation.replies(messages):
            return _next_turn(job, prompt_id, gpu, state, turns, made[0])
        row = build_conversation_row(prompt_id, messages, turns, last=completion, job=job,
                                     gpu=gpu, params=params, server=server)
        # The index of rows keeps the script, which a regenerate starts from again.
        bare_entry = bare_entry or encode_messages(messages)
    else:
        row = build_row(prompt_id, messages, completion, job=job, gpu=gpu, params=params,
                        attempts=attempts, server=server)
    recorded = durable("recording the row",
                       lambda: runtime().book.complete(job, prompt_id, gpu, row,
                                                       bare_entry=bare_entry, made=made))
    if recorded:
        _drop_handed_on(job, state)
    return {"id": prompt_id, "finish_reason": completion.finish_reason,
            "completion_tokens": completion.completion_tokens, "attempts": attempts,
            **({} if recorded else {"skipped": "duplicate delivery"})}


def _read_body(task, job: JobName, prompt_id: str, gpu: GpuName, tries: int,
               state) -> list | dict | None:
    """The entry of a prompt whose body is kept on storage (ledger/bodies.py): its messages, or
    those of a truncated row that regenerate --continue took back, with what its continuation
    needs. A storage fault is never the prompt's: it spends no attempt and fails no prompt.
    - the storage does not answer (S3 out, a dead mount's EIO): waited out like a server that
      does not answer, retried with backoff; once the outage has lasted breaker_wait_s the GPU's
      breaker opens and says so (status), until a read works again;
    - it answers that the chunk is not there (a directory not mounted on this node: a reader
      cannot tell it from a chunk removed), or it refuses this node (credentials, a file's
      permissions): the GPU's breaker opens at once with the reason (status), beat hands its
      prompts to the job's other GPUs, and it probes by reading again; the prompts wait until
      a GPU can read them;
    - the chunk answers with bytes that are not the prompt's (shorter than its reference, not
      a zstd frame, not JSON, not a conversation): the prompt fails for good
      (prompt_body_corrupt); the ledger cannot say where they are: prompt_body_missing.
    None when the prompt left this GPU while its breaker held it."""
    circuit, s = runtime().breaker(gpu), get_settings()
    if not circuit.closed:
        # Held (the storage, or the server): wait before reading, or each prompt handed back
        # to the queue would come straight back here and read again, at read speed.
        if not circuit.wait_closed(s.breaker_wait_s):
            raise Reject(f"{gpu} held ({circuit.last_error[:300]}): prompt returned to its "
                         "queue", requeue=True)
        if not durable("reading the prompt", runtime().book.task_state, job, prompt_id,
                       gpu).in_flight_here:
            return None
    outage = runtime().prompt_storage
    try:
        if state.body_location is None:
            raise bodies.BodyLost(f"job {job} records no location for its prompt bodies")
        storage = storage_at(state.body_location, s, readers=runtime().pool_size())
        entry = bodies.read_body(storage, job, state.body_reference)
    except (StorageCorrupt, bodies.BodyCorrupt) as exc:
        _record_failure(job, prompt_id, gpu, reason="prompt_body_corrupt", klass="permanent",
                        error=str(exc), status=None, attempts=tries)
    except bodies.BodyLost as exc:
        _record_failure(job, prompt_id, gpu, reason="prompt_body_missing", klass="permanent",
                        error=str(exc), status=None, attempts=tries)
    except (StorageNotFound, StorageDenied) as exc:
        missing = isinstance(exc, StorageNotFound)
        if missing and not bodies.still_waits(runtime().r, job, prompt_id, state.body_reference):
            # A stale delivery: the generation went on since, and the chunk of the entry it
            # read was removed (_drop_handed_on). Nothing is missing.
            return None
        hint = f" (is {state.body_location} mounted on this node?)" \
            if missing and not state.body_location.startswith("s3://") else ""
        circuit.trip("prompt_storage_missing" if missing else "prompt_storage_denied",
                     f"job {job}: {exc}{hint}",
                     partial(_readable, storage, job, prompt_id, state.body_reference),
                     probing="reads of the prompts' texts")
        raise Reject(f"{gpu}: {exc}: prompt returned to its queue", requeue=True) from None
    except StorageError as exc:
        policy = RetryPolicy.from_settings(s)
        countdown = policy.backoff_s(min(task.request.retries, 10))
        if not durable("counting a retry", runtime().book.note_retry, job, prompt_id, gpu,
                       "prompt_storage", time.time() + countdown):
            return None
        # One warning per outage, not one per thread and retry (the rest at DEBUG).
        log.log(logging.WARNING if outage.failed() else logging.DEBUG,
                "prompt %s on %s: cannot read its text (%s); again in %.1fs, no attempt spent "
                "(prompts wait until the storage answers)", prompt_id, gpu, exc, countdown)
        if (lasted := outage.lasted_s()) >= s.breaker_wait_s:
            circuit.trip("prompt_storage", f"prompt texts unreadable for {lasted:.0f}s: {exc}",
                         partial(_readable, storage, job, prompt_id, state.body_reference),
                         kind=TRANSIENT, probing="reads of the prompts' texts")
        raise task.retry(exc=exc, countdown=countdown, queue=gpu,
                         args=(job, prompt_id, gpu), kwargs={"tries": tries})
    if (ended := outage.succeeded()) is not None:
        log.warning("prompt texts readable again after %.0fs (%d reads failed meanwhile)",
                    ended[1], ended[0])
    return entry


def _readable(storage, job: JobName, prompt_id: str, reference: bytes) -> bool:
    """The breaker's probe while prompt texts cannot be read: one read of the prompt's bytes.
    A chunk that answers, whole or cut short, is readable (what it holds is the prompt's
    business, not the GPU's); so is one no prompt waits for any more (done elsewhere, its job
    deleted), or the GPU would stay held for good."""
    try:
        bodies.read_frame(storage, job, reference)
        return True
    except StorageCorrupt:
        return True
    except StorageError:
        return not bodies.still_waits(runtime().r, job, prompt_id, reference)


def _kept_reference(state: TaskState) -> bytes | None:
    """The reference of a prompt whose text is on storage, kept by the entry of a generation
    moved or between rounds: only the prompt's own (not that of a regenerated entry's chunk)."""
    bare = state.bare_entry
    return bare if bare is not None and bodies.is_reference(bare) else None


def _entry(job: JobName, messages: list[dict], ongoing: Ongoing | None, state: TaskState,
           turns: list[dict] | tuple[dict, ...] | None = None) -> bytes:
    """The prompt's entry that goes on from `ongoing` (None: from the start of a reply) after a
    conversation's replies `turns` (the state's by default), as `prompts` stores it
    (store_entry)."""
    return store_entry(runtime().book.r, get_settings(), job,
                       entry_frame(messages, ongoing, _kept_reference(state),
                                   state.turns if turns is None else turns),
                       readers=runtime().pool_size())


def entry_frame(messages: list[dict], ongoing: Ongoing | None, reference: bytes | None,
                turns: list[dict] | tuple[dict, ...] = ()) -> bytes:
    """A generation's entry, compressed: its prompt, a conversation's replies made so far, where
    the one being generated stands, and the reference of a prompt whose text is kept on storage
    (for the index of rows by finish reason)."""
    entry: dict = {"messages": messages, "handed_on": True}
    if ongoing is not None:
        entry["continue"] = ongoing.entry()
    if turns:
        entry["turns"] = list(turns)
    if reference is not None:
        entry["reference"] = reference.decode()
    return compress_messages_json(json.dumps(entry, separators=(",", ":")).encode())


def store_entry(r, s, job: JobName, frame: bytes, *, readers: int | None = None) -> bytes:
    """What `prompts` keeps of a generation's entry: a reference to a chunk of the job's body
    storage that holds it (ledger/bodies.py), as a truncated row's prefix is kept. Inline, its
    ids would cost Redis about 3.5 bytes a token (28 KB at 8,192), and the end game holds up to
    ~11.5 per slot of the job's GPUs (benchmarks, case 14); the reference is about 20 bytes.
    Storage that does not answer keeps the entry inline meanwhile: the outage costs Redis, never
    the generation."""
    try:
        # Only a job whose prompt texts are kept on storage (--bodies storage, or truncated rows
        # taken back by regenerate --continue) keeps its generations there: a job of Redis
        # bodies is a small one, and its output's S3 must not hold up the end game when out.
        location = jobs.body_location(r, job)
        if location is None:
            return frame
        _mounted_or_fail(r, job, location)
        storage = storage_at(location, s, readers=readers)
        return bodies.ChunkWriter(r, job, location, storage)([frame])[0]
    except JobDeleted:
        return frame  # the hand-on finds no job and writes nothing
    except StorageError as exc:
        log.warning("job %s: a generation's entry stays in Redis: its storage failed (%s)", job,
                    exc)
        return frame


def _mounted_or_fail(r, job: JobName, location: str) -> None:
    """A local body location whose job has chunks must show them: on a node where the shared
    directory is not mounted, writing would make the job's folder under the bare mount point,
    and the chunk would be hidden once the mount is back (its prompt then held for good)."""
    if location.startswith("s3://") or not jobs.last_body_chunk(r, job):
        return
    folder = Path(location) / bodies.chunks_prefix(job)
    if not folder.is_dir():
        raise StorageNotFound(f"{folder} is missing: is {location} mounted on this node?")


def _drop_handed_on(job: JobName, state: TaskState) -> None:
    """Remove the chunk of the entry this task went on from, once its successor is stored or
    its row recorded: it was written for this one generation (_entry), and nothing reads it
    again. Best effort: one left behind goes with the job's other chunks (`delete`)."""
    if state.handed_on_chunk is None:
        return
    try:
        storage = storage_at(state.body_location, get_settings(), readers=runtime().pool_size())
        bodies.remove_entry_chunk(storage, job, state.handed_on_chunk)
    except (StorageError, ValueError) as exc:
        log.debug("job %s: a used entry's chunk was not removed (%s)", job, exc)


def _hand_over(job: JobName, prompt_id: str, gpu: GpuName, state: TaskState,
               ongoing: Ongoing | None, params: GenerationParams, partial: Completion | Generation,
               attempts: int) -> dict | None:
    """A generation aborted here with its partial output, to go on elsewhere from its exact
    tokens: ordered moved to a faster GPU at the end of the run (take.lua, worker/migration.py),
    or this worker is stopping (then back to the front of pending, for the job's other GPUs).
    Its entry becomes the one that continues it, and the prompt moves there (hand_over.lua); the
    row made there counts each token once and names every GPU that worked on it. One that could
    not go on exactly (a penalised generation) starts over there. None when the abort was
    neither (it is retried as before)."""
    book, stopping = runtime().book, runtime().shutdown.requested()
    target = None if stopping else window.migration_target(book.r, job, prompt_id, gpu)
    if target is None and not stopping:
        return None
    part = Part.of(partial)
    if ongoing is None and isinstance(partial, Completion) and partial.prompt_token_ids is None:
        return None  # no ids to go on from
    grown = (ongoing or Ongoing.started(partial, params)).went_on(part, gpu, attempts)
    if params.continuable:
        frame = _entry(job, state.messages, grown, state)
    elif state.turns:  # the reply starts over there, after the conversation's earlier ones
        frame = _entry(job, state.messages, None, state)
    else:
        frame = state.bare_entry or encode_messages(state.messages)
    if not durable("handing the generation over", window.hand_over, book.r, job, prompt_id, gpu,
                   target, frame, len(part.ids), state.entry_digest,
                   held=grown.generated if params.continuable else 0):
        return {"id": prompt_id, "skipped": "no longer in flight here: not handed over"}
    _drop_handed_on(job, state)
    runtime().settings.failpoint("generate.after_hand_over")
    if target is not None:
        publish(app, job, target, [prompt_id])
    log.info("prompt %s: %d tokens generated on %s, continued on %s", prompt_id, len(part.ids),
             gpu, target or "another GPU (this worker stops)")
    return {"id": prompt_id, "moved_to": target or "pending", "tokens": len(part.ids)}


def _overflows(client: SGLangClient, prompt_tokens: int, params: GenerationParams) -> bool:
    """The prompt and the job's cap exceed the model's context (the server's own check)."""
    context = client.context_length()
    return context is not None and prompt_tokens + params.max_tokens > context


def _next_round(job: JobName, prompt_id: str, gpu: GpuName, state: TaskState, grown: Ongoing,
                made: Part | None) -> dict:
    """A generation cut at its round's end (window.round_cap), or ended but not yet decoded: to
    the back of pending with its exact tokens, for whichever GPU frees a slot to go on
    (next_round.lua). Only while the prompt's entry is still the one this request started from:
    a stale second delivery of an earlier round hands nothing on."""
    tokens = len(made.ids) if made is not None else 0
    if not durable("handing the generation to its next round", window.next_round,
                   runtime().book.r, job, prompt_id, gpu, _entry(job, state.messages, grown, state),
                   tokens, state.entry_digest, held=grown.generated):
        return {"id": prompt_id, "skipped": "no longer in flight here: not handed on"}
    _drop_handed_on(job, state)
    return {"id": prompt_id, "next_round": True, "tokens": tokens}


def _next_turn(job: JobName, prompt_id: str, gpu: GpuName, state: TaskState,
               turns: list[dict], tokens: int) -> dict:
    """A conversation's reply made, and more to make: its entry now holds the replies so far,
    and it goes to the front of pending (next_round.lua), where this GPU's refill, right after,
    most likely takes it, its context in the server's prefix cache. The conversations in
    progress are those in flight, not every one started: their entries are what Redis holds.
    In the end game's rounds it goes to the back instead (window.in_rounds), so the last
    conversations run side by side instead of one chain of replies per slot (benchmarks, case
    16). Only while the prompt's entry is still the one this reply started from (a stale
    second delivery hands nothing on)."""
    if not durable("handing the conversation to its next reply", window.next_round,
                   runtime().book.r, job, prompt_id, gpu,
                   _entry(job, state.messages, None, state, turns), tokens, state.entry_digest,
                   front=not window.in_rounds(get_settings(), state.pending, _slots(state)),
                   turn=True):
        return {"id": prompt_id, "skipped": "no longer in flight here: not handed on"}
    _drop_handed_on(job, state)
    return {"id": prompt_id, "next_turn": len(turns), "tokens": tokens}


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
