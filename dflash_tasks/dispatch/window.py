"""A GPU's window of a job in Redis, and every decision about where a prompt runs: take (top the
window up from pending and publish the messages, with the end game: steal from slower GPUs'
queues, leave the last prompts to faster ones, order a running generation moved), recall,
drop a settled prompt, hand a moved generation over, and the end game's rounds (how far a
request may run, and the next round of one cut there). Each decision is a script in `lua/` or a
function here; its thresholds are settings passed in (core/settings.py: endgame_faster_ratio,
migration_order_lapse_s, endgame_round_tokens, endgame_rounds_depth)."""
from __future__ import annotations

from typing import Sequence

import redis

from dflash_tasks.core.keys import (
    BREAKERS,
    MEMORY_HOLD,
    MIGRATIONS,
    WORKERS,
    WORKERS_SEEN,
    GpuName,
    JobName,
)
from dflash_tasks.core.scripts import Script
from dflash_tasks.core.settings import Settings

TAKE = Script(__file__, "take")
RECALL = Script(__file__, "recall")
DROP_SETTLED = Script(__file__, "drop_settled")
HAND_OVER = Script(__file__, "hand_over")
NEXT_ROUND = Script(__file__, "next_round")


def take(r: redis.Redis, s: Settings, job: JobName, gpu: GpuName, window: int, *, task: str,
         origin: str, reply_to: str) -> list[str]:
    """Top gpu's window up from pending and publish a `task` message per id taken onto its
    queue, in one call; at the end of the run, steal from the job's other GPUs (take.lua).
    Nothing when the job's GPU selection does not allow `gpu`, nor while dispatch is held (the
    job's batches can go nowhere, or Redis is near its maxmemory), nor, at the very end of the
    run, on a GPU measurably slower than others that are alive (a heartbeat within
    worker_gone_after_s) and will free a slot sooner, unless the end game runs in rounds.
    Returns the ids taken."""
    ids = TAKE(r, config=job.config, pending=job.pending, inflight=job.inflight(gpu), gpus=job.gpus,
               queue=gpu, hold=job.hold, memory_hold=MEMORY_HOLD, speed=job.speed,
               seen=WORKERS_SEEN, workers=WORKERS, breakers=BREAKERS, migrating=job.migrating,
               window=window, job=job, gpu=gpu, task=task, origin=origin, reply_to=reply_to,
               inflight_prefix=job.inflight(""), alive_s=s.worker_gone_after_s,
               migrations_prefix=MIGRATIONS, retrying_prefix=job.retrying(""),
               faster_ratio=s.endgame_faster_ratio, order_lapse_s=s.migration_order_lapse_s,
               rounds=int(s.endgame_round_tokens > 0))
    return [_s(i) for i in ids]


def recall(r: redis.Redis, job: JobName, gpu: GpuName, ids: Sequence[str] = ()) -> int:
    """Put prompts in flight on `gpu` (`ids`, or all) back in front of pending (recall.lua)."""
    return int(RECALL(r, inflight=job.inflight(gpu), pending=job.pending, done=job.done, ids=ids))


def drop_settled(r: redis.Redis, job: JobName, gpu: GpuName, prompt_id: str) -> bool:
    """Take a prompt that has its outcome (done, failed) or left the job out of gpu's in-flight
    set, checked in the same step (drop_settled.lua): one taken back and dispatched here again
    since the caller looked keeps its fresh entry. True when removed."""
    return bool(DROP_SETTLED(r, inflight=job.inflight(gpu), done=job.done, failed=job.failed,
                             prompts=job.prompts, id=prompt_id))


def restamp_inflight(r: redis.Redis, job: JobName, gpu: GpuName, ids: Sequence[str],
                     at: float) -> None:
    """Dispatched again now (the reaper): their in-flight time restarts; an id that left the
    set meanwhile (its outcome arrived) is not put back."""
    if ids:
        r.zadd(job.inflight(gpu), {i: at for i in ids}, xx=True)


# -- a running generation moved to a faster GPU (the end game's last step) ------------------------

def migration_target(r: redis.Redis, job: JobName, prompt_id: str, gpu: GpuName) -> str | None:
    """The GPU take.lua ordered this prompt's generation on `gpu` moved to, if any."""
    order = r.hget(job.migrating, prompt_id)
    if order is None:
        return None
    source, target, _ = order.decode().split(" ")
    return target if source == gpu else None


def hand_over(r: redis.Redis, job: JobName, prompt_id: str, source: str, target: str | None,
              entry: bytes, tokens: int, started_from: str, rate_bucket_s: int = 10, *,
              held: int = 0) -> bool:
    """Move a generation aborted on `source` to `target` (None: the front of pending), its entry
    now the one that goes on from its partial output, `held` tokens in all (hand_over.lua).
    False when the order changed, the prompt left `source` or its entry is no longer the one of
    SHA-1 `started_from` (ledger.TaskState.entry_digest) meanwhile (nothing moved)."""
    return bool(HAND_OVER(r, migrating=job.migrating, inflight_source=job.inflight(source),
                          inflight_target=job.inflight(target or source), prompts=job.prompts,
                          pending=job.pending, counters=job.counters, config=job.config,
                          rate=job.rate, going_on=job.going_on, id=prompt_id, entry=entry,
                          source=source, target=target or "", tokens=tokens,
                          started_from=started_from, rate_bucket_s=rate_bucket_s, held=held))


# -- the end game in rounds --------------------------------------------------------------------

def round_cap(s: Settings, max_tokens: int, generated: int, pending: int, slots: int, *,
              overflows: bool = False) -> int:
    """How many output tokens in all a request may reach: the job's cap, or, once fewer
    prompts are pending than endgame_rounds_depth per request the job's GPUs run at once
    (`slots`), one round (endgame_round_tokens) more than it has. Without rounds, a long
    generation started in the last minutes decides the end of the run, and which ones are long
    shows only once they have run; in rounds, every prompt is started before any goes on, the
    long ones show themselves after a round and go on while the rest is still pending, and the
    last starts are a round long at most (benchmarks, cases 7 and 13). `overflows`: the prompt
    and the job's cap exceed the model's context; the request asks for the whole cap, so the
    server refuses it in its own words, as it would without rounds."""
    if s.endgame_round_tokens <= 0 or overflows or not in_rounds(s, pending, slots):
        return max_tokens
    return min(max_tokens, generated + s.endgame_round_tokens)


def in_rounds(s: Settings, pending: int, slots: int) -> bool:
    """Whether the job is in its end game's rounds: fewer prompts pending than
    endgame_rounds_depth per request its GPUs run at once (`slots`). A conversation's next reply
    goes to the front of pending before (its conversation finishes before others start: those
    in progress are about those in flight), to the back once in rounds (every conversation left
    starts, and their turns take turns in the slots: chains of replies, each waiting on the
    last, would otherwise end one by one in slots left idle)."""
    return pending < s.endgame_rounds_depth * slots


def next_round(r: redis.Redis, job: JobName, prompt_id: str, gpu: GpuName, entry: bytes,
               tokens: int, started_from: str, rate_bucket_s: int = 10, *,
               turn: bool = False, front: bool = False, held: int = 0) -> bool:
    """A generation cut at its round's end on `gpu`: its entry now the one that goes on from
    there, `held` tokens in all (kept for the ETA; 0: a reply starting), to the back of pending
    (next_round.lua), or the `front`; with `turn`, a conversation's reply made, for its next
    (counted as a turn, not a round). False when the prompt left `gpu`, or its entry is no
    longer the one of SHA-1 `started_from` (ledger.TaskState.entry_digest), meanwhile (nothing
    moved)."""
    return bool(NEXT_ROUND(r, inflight=job.inflight(gpu), prompts=job.prompts,
                           pending=job.pending, counters=job.counters, config=job.config,
                           rate=job.rate, going_on=job.going_on, id=prompt_id, entry=entry,
                           tokens=tokens, started_from=started_from, gpu=gpu,
                           rate_bucket_s=rate_bucket_s, turn="1" if turn else "0",
                           front="1" if front else "0", held=held))


def migrations(r: redis.Redis, gpu: GpuName, timeout_s: float) -> tuple[str, str] | None:
    """The next (job, prompt id) whose generation on `gpu` is to be handed over, waiting up to
    timeout_s for one (take.lua pushes them)."""
    got = r.blpop([MIGRATIONS + gpu], timeout=timeout_s)
    if got is None:
        return None
    job, _, prompt_id = got[1].decode().partition("\n")
    return job, prompt_id


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
