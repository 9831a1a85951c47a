"""Windowed dispatch: each GPU queue holds about its worker's concurrency times a small factor
of tasks; every finished task tops its own queue up from the job's pending list. So no
million-message backlog sits in the broker, and a faster GPU simply takes more prompts."""
from __future__ import annotations

import base64
import json
import logging
import math
import time
from dataclasses import dataclass
from functools import lru_cache

import redis
from celery import Celery

from dflash_tasks.core import jobs
from dflash_tasks.core.keys import (
    BREAKERS,
    GENERATE_TASK,
    WORKERS,
    WORKERS_SEEN,
    GpuName,
    JobName,
)
from dflash_tasks.core.settings import Settings
from dflash_tasks.dispatch import window as window_steps
from dflash_tasks.ledger import Ledger

UNACKED = "unacked"   # kombu's Redis transport: delivered, not yet acknowledged messages
log = logging.getLogger(__name__)


def registered_gpus(r: redis.Redis) -> list[GpuName]:
    """Every GPU whose worker ever registered (hooks.py), alive or not, by node and index."""
    return GpuName.among(r.hkeys(WORKERS))


def dispatched_gpus(r: redis.Redis, job: JobName) -> list[GpuName]:
    """Every GPU the job ever dispatched to (take.lua records them), by node and index."""
    return GpuName.among(r.smembers(job.gpus))


def job_gpus(r: redis.Redis, job: jobs.Job) -> list[GpuName]:
    """The GPUs a job shows and looks after: those it ever dispatched to (where its prompts may
    be, whether it still uses them or not) and the registered ones its selection allows (where
    they may go)."""
    known = set(dispatched_gpus(r, job.name))
    known.update(g for g in registered_gpus(r) if job.selection.allows(g))
    return sorted(known, key=GpuName.order)


def serving_gpus(book: Ledger, s: Settings, job: jobs.Job) -> list[GpuName]:
    """The GPUs that take the job's work now: allowed by its selection, their worker alive and
    its breaker closed (unavailable_gpus)."""
    allowed = [g for g in job_gpus(book.r, job) if job.selection.allows(g)]
    unavailable = unavailable_gpus(book.r, allowed, s)
    return [g for g in allowed if g not in unavailable]


def topup_all(app: Celery, book: Ledger, s: Settings, job: jobs.Job) -> int:
    """Fill the window of every GPU serving the job (an enqueue, a resume, a retry); returns how
    many tasks were published. When fewer prompts wait than the windows have room for (a small
    job, the last of a large one), they are shared out in proportion to the windows (the
    workers' concurrency), instead of the first window taking them all. GPUs that register
    later are filled by their worker at start-up and by beat's maintain."""
    gpus = serving_gpus(book, s, job)
    if not gpus:
        return 0
    windows = {gpu: window_for(book.r, s, gpu) for gpu in gpus}
    pipe = book.r.pipeline(transaction=False)
    pipe.llen(job.name.pending)
    for gpu in gpus:
        pipe.zcard(job.name.inflight(gpu))
    pending, *busy = pipe.execute()
    room = {gpu: max(0, windows[gpu] - n) for gpu, n in zip(gpus, busy)}
    share = split(pending, room) if pending < sum(room.values()) else room
    return sum(topup(app, book, s, job.name, gpu, target=windows[gpu] - room[gpu] + share[gpu])
               for gpu in gpus if share[gpu])


def split(n: int, capacity: dict[str, int]) -> dict[str, int]:
    """n items shared out in proportion to each one's capacity, none above it (largest
    remainders first, so the shares add up to n when the capacities allow)."""
    total = sum(capacity.values())
    if total <= 0:
        return dict.fromkeys(capacity, 0)
    exact = {key: n * c / total for key, c in capacity.items()}
    share = {key: min(capacity[key], int(x)) for key, x in exact.items()}
    for key in sorted(exact, key=lambda k: exact[k] - int(exact[k]), reverse=True):
        if sum(share.values()) >= min(n, total):
            break
        if share[key] < capacity[key]:
            share[key] += 1
    return share


def worker_concurrency(r: redis.Redis, s: Settings, gpu: GpuName) -> int:
    """The concurrency the GPU's worker registered at start-up (one HGET: a refill follows a
    request of seconds, and a worker restarted with another concurrency counts at once)."""
    raw = r.hget(WORKERS, gpu)
    return json.loads(raw)["concurrency"] if raw else s.default_concurrency


def window_for(r: redis.Redis, s: Settings, gpu: GpuName, concurrency: int | None = None) -> int:
    """The GPU's window: its worker's concurrency (`concurrency` when the caller knows it, else
    the registered one) times DFLASH_WINDOW_FACTOR."""
    return max(1, math.ceil((concurrency or worker_concurrency(r, s, gpu)) * s.window_factor))


def publish(app: Celery, job: JobName, gpu: GpuName, prompt_ids: list[str]) -> None:
    if not prompt_ids:
        return
    with app.producer_or_acquire() as producer:
        for prompt_id in prompt_ids:
            app.send_task(GENERATE_TASK, args=(job, prompt_id, gpu), queue=gpu,
                          producer=producer, ignore_result=True)  # the message's word wins


def topup(app: Celery, book: Ledger, s: Settings, job: JobName, gpu: GpuName,
          concurrency: int | None = None, target: int | None = None) -> int:
    """Fill gpu's window for job from pending, if the job's selection allows the GPU; returns
    how many tasks were published.

    One round trip: take.lua moves the ids to the GPU's in-flight set and LPUSHes their Celery
    messages in the same call (no kombu publish, no task-sent event per refill). Once pending is
    empty, a GPU with an empty queue takes one waiting prompt from the longest other queue of the
    job (see take.lua): the end of a run is not spent waiting for the slowest GPU's backlog. And
    the last few prompts are left to GPUs measurably faster than this one, when they are alive.

    `concurrency`: the GPU's own worker passes its own (the window's size without reading the
    registry: a round trip less per completion); beat reads what the worker registered.
    `target`: fill only up to that many in flight (topup_all's share of a small job)."""
    window = target if target is not None else window_for(book.r, s, gpu, concurrency)
    ids = window_steps.take(book.r, s, job, gpu, window, task=GENERATE_TASK, origin=_origin(),
                            reply_to=app.thread_oid)
    return len(ids)


@lru_cache(maxsize=1)
def _origin() -> str:
    from celery.utils.nodenames import anon_nodename

    return anon_nodename()


def withdraw_cancelled(book: Ledger, name: JobName) -> int:
    """What follows a job's move to cancelled (after it: take.lua dispatches nothing from then
    on): its messages still queued are withdrawn, requests already running finish and are kept.
    The prompts not generated stay in the job, counted in its total, so `resume` finishes them
    all. Returns how many wait."""
    for gpu in dispatched_gpus(book.r, name):
        withdraw(book, name, gpu, everything=False)
    return int(book.r.llen(name.pending))


def withdraw(book: Ledger, job: JobName, gpu: GpuName, *, everything: bool) -> int:
    """Remove `job`'s queued messages from `gpu`'s queue and put their prompts back in front of
    pending; with `everything` (a GPU the job no longer uses), also the prompts whose messages a
    worker already holds. Requests already running finish either way (the ledger keeps one row).
    Returns how many prompts went back."""
    withdrawn = _remove_queued(book.r, job, gpu)
    back = window_steps.recall(book.r, job, gpu, withdrawn) if withdrawn else 0
    return back + (window_steps.recall(book.r, job, gpu) if everything else 0)


def _remove_queued(r: redis.Redis, job: JobName, gpu: GpuName,
                   only: set[str] | None = None) -> list[str]:
    """Take `job`'s messages (those of the ids in `only`, if given) out of `gpu`'s queue; returns
    the ids whose message this call removed (a worker may pop one first)."""
    queue = gpu
    removed = []
    for raw in r.lrange(queue, 0, -1):
        job_of, prompt_id = _job_and_id(raw)
        if job_of == job and (only is None or prompt_id in only) and r.lrem(queue, 1, raw):
            removed.append(prompt_id)
    return removed


def reap(app: Celery, book: Ledger, s: Settings, job: JobName, gpu: GpuName,
         unacked: "UnackedLook | None" = None) -> int:
    """Dispatch again the prompts in flight on `gpu` whose message is gone; returns how many.

    Two ways to be gone: (1) in flight for `reap_after_s` (a broker restart without persistence
    loses every message); (2) in flight for `lost_message_grace_s` with no message for it in the
    GPU's queue nor among the broker's unacknowledged messages, on two looks a second apart. (2)
    happens even with persistence: a Redis crash between a worker's BRPOP and its write of the
    unacknowledged record, a BRPOP reply lost with the connection, a top-up whose publish failed
    after it took the ids. A copy that still exists somewhere is harmless: the ledger counts a
    prompt once."""
    r = book.r
    key = job.inflight(gpu)
    now = time.time()
    stale = {m.decode() for m in r.zrangebyscore(key, "-inf", now - s.reap_after_s, start=0,
                                                 num=10_000)}
    lost = find_lost(r, job, gpu, s.lost_message_grace_s, unacked or UnackedLook(r)) - stale
    if lost:
        log.warning("job %s %s: %d prompt(s) in flight without a message anywhere "
                    "(a broker crash lost them); dispatching them again", job, gpu, len(lost))
    again = sorted(stale | lost)
    if again:
        window_steps.restamp_inflight(book.r, job, gpu, again, now)
        publish(app, job, gpu, again)
    return len(again)


def find_lost(r: redis.Redis, job: JobName, gpu: GpuName, grace_s: float,
              unacked: "UnackedLook") -> set[str]:
    """Ids in flight on `gpu` for `grace_s` or more whose task message is neither in the GPU's
    queue nor unacknowledged in any worker (ETA retries included), on two looks."""
    key = job.inflight(gpu)
    cutoff = time.time() - grace_s
    old = {m.decode() for m in r.zrangebyscore(key, "-inf", cutoff, start=0, num=10_000)}
    if not old:
        return set()
    missing = old - messages_present(r, job, gpu, unacked.ids())
    if not missing:
        return set()
    time.sleep(1.0)  # a message between BRPOP and its unacked record shows on the second look
    missing -= messages_present(r, job, gpu, unacked.ids(fresh=True))
    if not missing:
        return set()
    scores = r.zmscore(key, sorted(missing))
    return {m for m, score in zip(sorted(missing), scores) if score is not None and score <= cutoff}


class UnackedLook:
    """The (job, prompt id) of every generate message the broker holds unacknowledged, read
    once per look and shared by every GPU of a maintain run (one HSCAN of `unacked`, not one per
    GPU and job); `fresh` reads it again."""

    def __init__(self, r: redis.Redis):
        self.r = r
        self._ids: set[tuple[str, str]] | None = None

    def ids(self, fresh: bool = False) -> set[tuple[str, str]]:
        if fresh or self._ids is None:
            self._ids = {_job_and_id(payload) for _, payload, _, _ in _unacked(self.r)}
        return self._ids


def messages_present(r: redis.Redis, job: JobName, gpu: GpuName,
                     unacked: set[tuple[str, str]]) -> set[str]:
    """Prompt ids of `job` with a generate message in the GPU's queue or among `unacked`."""
    present = {pid for j, pid in map(_job_and_id, r.lrange(gpu, 0, -1)) if j == job}
    return present | {pid for j, pid in unacked if j == job}


def _unacked(r: redis.Redis):
    """(delivery tag, message, exchange, routing key) of every message kombu's transport holds
    unacknowledged (`unacked`: tag -> [message, exchange, routing key]); an entry it cannot read
    is passed over."""
    for tag, raw in r.hscan_iter(UNACKED, count=1000):
        try:
            payload, exchange, routing_key = json.loads(raw)
        except (ValueError, TypeError):
            continue
        yield tag.decode() if isinstance(tag, bytes) else tag, payload, exchange, routing_key


def _job_and_id(entry) -> tuple[str, str]:
    """(job, prompt id) of a generate task message in kombu's envelope; ("", "") otherwise."""
    try:
        payload = json.loads(entry) if isinstance(entry, (bytes, str)) else entry
        if payload.get("headers", {}).get("task") != GENERATE_TASK:
            return "", ""
        body = payload["body"]
        if payload.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        return str(args[0]), str(args[1])
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return "", ""


def restore_unheld(app: Celery, r: redis.Redis, queues: list[str], held: set[str]) -> int:
    """Put back in their queue the unacknowledged messages of `queues` whose delivery tag is not
    in `held` (what this worker is running now). A GPU worker calls it each time its consumer
    (re)connects: at start-up, what a killed predecessor held; after a Redis restart, its own
    retries that were waiting for their ETA, which Celery drops with the lost connection. They
    come back now instead of after the visibility timeout (hours). One worker consumes a GPU
    queue, so nobody else can hold them; a copy that is in fact still running somewhere is
    harmless (the ledger records a prompt once). Returns how many were restored."""
    tags = [tag for tag, _, exchange, routing_key in _unacked(r)
            if (routing_key in queues or exchange in queues) and tag not in held]
    if not tags:
        return 0
    with app.connection_for_write() as conn:
        qos = conn.default_channel.qos
        for tag in tags:
            qos.restore_by_tag(tag)
    return len(tags)


@dataclass(frozen=True, slots=True)
class Unavailable:
    """A GPU that takes no work now, why, and the age past which its prompts go to the job's
    other GPUs (drain_gone)."""
    why: str
    older_than_s: float


def unavailable_gpus(r: redis.Redis, gpus: list[GpuName], s: Settings) -> dict[str, Unavailable]:
    """The GPUs among `gpus` that take no work, and since when their prompts go elsewhere:
    - a worker gone: no heartbeat (heartbeat.py) for `worker_gone_after_s` (killed, its node
      lost: a restart may yet come back to its queue), its prompts dispatched before then; one
      that stopped cleanly (which removes the stamp: a node leaving, a warm stop) or never
      stamped, all of them at once. A worker restarted cleanly takes new work at once.
    - a worker alive whose breaker is open (breaker.py): misconfigured or failing every request
      the same way, at once; a server that stopped answering, once it has been open for
      `breaker_handover_s`. Its messages held meanwhile are skipped when they run."""
    seconds, micros = r.time()
    now = seconds + micros / 1e6
    names = [g for g in gpus]
    stamps = r.hmget(WORKERS_SEEN, names) if gpus else []
    breakers = r.hmget(BREAKERS, names) if gpus else []
    out: dict[str, Unavailable] = {}
    for gpu, stamp, raw in zip(gpus, stamps, breakers):
        if stamp is None:
            out[gpu] = Unavailable("its worker stopped", 0.0)
        elif now - float(stamp) > s.worker_gone_after_s:
            out[gpu] = Unavailable(f"no heartbeat for {s.worker_gone_after_s}s",
                                   s.worker_gone_after_s)
        elif (breaker := _open_breaker(raw)) is not None:
            kind, since, error = breaker
            if kind != "transient" or time.time() - since >= s.breaker_handover_s:
                out[gpu] = Unavailable(f"its circuit breaker is open ({kind}: {error})", 0.0)
    return out


def _open_breaker(raw: bytes | None) -> tuple[str, float, str] | None:
    """(kind, opened at, last error) of a published breaker that is open; None otherwise."""
    try:
        b = json.loads(raw) if raw else {}
    except ValueError:
        return None
    if b.get("state") != "open":
        return None
    return str(b.get("kind", "transient")), float(b.get("opened_at") or 0), str(b.get("last_error", ""))[:300]


def drain_gone(book: Ledger, job: JobName, gpu: GpuName, older_than_s: float) -> int:
    """A GPU that takes no work (unavailable_gpus says so, and says `older_than_s`): put the
    prompts dispatched to it more than `older_than_s` ago back in front of pending, withdrawing
    their queued messages, so the job's other GPUs generate them. A message its worker still
    held comes back with it (or wakes from the breaker's wait), finds its prompt no longer in
    flight there, and is skipped. Returns how many went back."""
    key = job.inflight(gpu)
    old = {m.decode() for m in book.r.zrangebyscore(key, "-inf", time.time() - older_than_s)}
    if not old:
        return 0
    _remove_queued(book.r, job, gpu, only=old)
    return window_steps.recall(book.r, job, gpu, sorted(old))
