"""The books in Redis: a job's prompts, done marks, counters and output rows, and each prompt's
outcomes (complete, fail, retry, reopen, requeue), each a Lua script in `lua/` (core/scripts.py
names their keys), so each multi-step change is atomic and reviewable on its own. The scripts
that decide other stages' things live with those stages: dispatch's (take, recall, hand over),
sealing's (output/), the worker registry's (worker/), a training run's (training/queue/).
`messages` is the stored form of a prompt's conversation.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Iterable, Iterator, Sequence

import redis

from dflash_tasks.core.connections import redis_client
from dflash_tasks.core.jobs import JobDeleted
from dflash_tasks.core.keys import GpuName, JobName
from dflash_tasks.core.lifecycle import STATES
from dflash_tasks.core.scripts import Script
from dflash_tasks.core.settings import Settings, get_settings
from dflash_tasks.ledger import bodies
from dflash_tasks.ledger.messages import decode_messages, encode_messages

log = logging.getLogger(__name__)
LAGGING_WARN_EVERY_S = 60.0
HIST_BUCKET_TOKENS = 64   # output-length histogram resolution, for percentiles without scans
SPEED_MIN_TOKENS = 64     # the shortest request that counts for its GPU's speed (take.lua)
# Rows that ended "stop" are most of a job and rarely generated again: they are not in the index
# of rows by finish reason (regenerate reads the batches to find them). Every other reason is.
UNINDEXED_REASONS = frozenset({"stop"})

ADD_PROMPTS = Script(__file__, "add_prompts")
UNKNOWN_IDS = Script(__file__, "unknown_ids")
COMPLETE = Script(__file__, "complete")
FAIL = Script(__file__, "fail")
RETRY = Script(__file__, "retry")
REQUEUE_FAILED = Script(__file__, "requeue_failed")
REOPEN = Script(__file__, "reopen")
FINISH = Script(__file__, "finish")
UPDATE_JOB = Script(__file__, "update_job")


@dataclass(frozen=True, slots=True)
class TaskState:
    """What a generate task needs, read in one round trip."""
    params: dict | None
    messages: list[dict] | None
    done: bool
    failed: bool = False  # in the failed registry: parked until `manage.py retry-failed`
    continuation: dict | None = None  # a truncated output to continue (regenerate --continue)
    # A conversation's replies made so far (enqueue --turns all): each a turn record
    # (output/rows.py's turn_record), the next reply generated after them.
    turns: tuple[dict, ...] = ()
    # Dispatched to this GPU and not recalled since (a message of a recalled prompt is stale).
    in_flight_here: bool = True
    # A body kept on storage (bodies.py): `messages` is None, and the task reads it from there.
    body_reference: bytes | None = None
    body_location: str | None = None
    # The `prompts` entry as read, when it is the prompt alone (its messages' frame, or a
    # reference), not the {messages, continue} of a regenerated one: the index of rows by finish
    # reason keeps it as it is (Ledger.complete).
    bare_entry: bytes | None = None
    # How many prompts of the job are pending, and how many GPUs it has dispatched to: whether
    # the end game's rounds have begun (dispatch/window.py's round_cap).
    pending: int = 0
    job_gpus: int = 0
    # The SHA-1 of the `prompts` entry as read: a generation is handed on (next_round.lua,
    # hand_over.lua) only from the entry its request started from, never by a stale delivery.
    entry_digest: str = ""
    # The reference of an entry a generation was handed on in (generate.py's _entry): its chunk
    # holds that entry alone, and goes once the generation has gone on from it.
    handed_on_chunk: bytes | None = None

    @property
    def stored(self) -> bool:
        """The prompt is still in the job's `prompts` (in Redis or as a reference)."""
        return self.messages is not None or self.body_reference is not None

    def with_body(self, decoded: list | dict) -> "TaskState":
        """This state with its body read from storage: a prompt's messages, or (a truncated row
        that regenerate --continue took back, whose entry is kept on storage too) its messages
        and what the continuation needs; such an entry is more than the prompt, so the index of
        rows by finish reason does not keep it as it is (bare_entry)."""
        if isinstance(decoded, dict):
            reference = decoded.get("reference")
            return replace(self, messages=decoded["messages"], continuation=decoded.get("continue"),
                           turns=tuple(decoded.get("turns") or ()),
                           bare_entry=reference.encode() if reference else None,
                           handed_on_chunk=self.body_reference if decoded.get("handed_on") else None)
        return replace(self, messages=decoded)


@dataclass(frozen=True, slots=True)
class EndedRow:
    """A done prompt's newest row as regenerate takes it back: its share of the counters and
    where it is, from the ledger's index of rows by finish reason (complete.lua), or from the row
    itself when it was read from a batch."""
    id: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    gpu: str  # the GPU the row was made on, as recorded
    # The row's stream entry id: in the stream until sealed, then in the batch whose first entry
    # is the last one at or before it (batches are consecutive runs of the stream).
    entry: str = ""
    prompt: bytes | None = None  # its messages as `prompts` stores them (encode_messages)
    # The index record's first line as read: reopen.lua takes the row back only while it is
    # still that one. Empty for a row read from a batch.
    indexed: str = ""
    looping: bool = False  # its output ends in a loop (metadata.loop: output/loops.py)

    @classmethod
    def from_row(cls, row: dict) -> "EndedRow":
        meta = row["metadata"]
        return cls(row["id"], meta["finish_reason"], int(meta["prompt_tokens"]),
                   int(meta["completion_tokens"]), made_by(meta), looping=bool(meta.get("loop")))


def made_by(meta: dict, gpu: str | None = None) -> str:
    """Which GPUs made a row, as the index of rows records it (complete.lua) and reopen.lua
    reads it: the GPU it was recorded on (`gpu`, else the row's), then "/" and each GPU's share
    for a row made in several requests ("gpu1@b/gpu0@a=2048,gpu1@b=612")."""
    recorded_on = gpu or meta["gpu"]
    shares = meta.get("gpus")
    if not shares:
        return recorded_on
    return recorded_on + "/" + ",".join(f"{s['gpu']}={int(s['tokens'])}" for s in shares)


def truncated_split(counters: dict[str, int]) -> dict:
    """The rows cut at the cap, looping (their output ends in a loop: more tokens buy more of
    it, output/loops.py) and still progressing (a higher cap may let them finish), and the
    looping ones' mean length, from the ledger's counters (complete.lua): every row, at O(1)."""
    truncated = counters.get("finish:length", 0)
    looping = counters.get("looping:length", 0)
    looping_tokens = counters.get("looping_tokens:length", 0)
    return {"rows": truncated, "looping": looping, "progressing": truncated - looping,
            "looping_mean_tokens": round(looping_tokens / looping) if looping else 0}


def entry_order(entry: str) -> tuple[int, int]:
    """A stream entry id ("<ms>-<seq>") as a sortable pair."""
    ms, _, seq = entry.partition("-")
    return int(ms), int(seq or 0)


class Ledger:
    def __init__(self, client: redis.Redis, *, wait_replicas: int = 0, wait_timeout_ms: int = 1000,
                 speed_weight: float = 0.05):
        self.r = client
        # Settings.speed_average_weight: how far each request moves its GPU's speed (complete.lua).
        self.speed_weight = speed_weight
        # Settings.redis_wait_replicas: rows (and batches) wait until the replicas have them.
        self.wait_replicas, self.wait_timeout_ms = wait_replicas, wait_timeout_ms
        self._lagging_warned_at = -LAGGING_WARN_EVERY_S

    # -- enqueue ---------------------------------------------------------------------------------

    def add_prompts(self, job: JobName, prompts: Sequence[tuple[str, str]]) -> int:
        """Store (id, messages_json) pairs not seen before and queue them; returns how many.
        Raises JobDeleted when the job was deleted meanwhile (nothing is stored then)."""
        added = int(ADD_PROMPTS(self.r, prompts=job.prompts, pending=job.pending, done=job.done,
                                counters=job.counters, config=job.config,
                                items=[x for pair in prompts for x in pair]))
        if added < 0:
            raise JobDeleted(f"job {job} was deleted while its prompts were being stored")
        return added

    def unknown_positions(self, job: JobName, ids: Sequence[str]) -> list[int]:
        """The 0-based positions of the ids the job neither stores nor has done (a resumed
        enqueue sends only those prompts' messages)."""
        return [i - 1 for i in UNKNOWN_IDS(self.r, prompts=job.prompts, done=job.done, ids=ids)]

    # -- a prompt's task -------------------------------------------------------------------------

    def task_state(self, job: JobName, prompt_id: str, gpu: GpuName) -> TaskState:
        pipe = self.r.pipeline(transaction=False)
        pipe.hmget(job.config, "params", "bodies")
        pipe.hget(job.prompts, prompt_id)
        pipe.sismember(job.done, prompt_id)
        pipe.hexists(job.failed, prompt_id)
        pipe.zscore(job.inflight(gpu), prompt_id)
        pipe.zrem(job.retrying(gpu), prompt_id)  # running now: its retry no longer waits
        pipe.llen(job.pending)
        pipe.scard(job.gpus)
        (params, location), entry, done, failed, here, _, pending, job_gpus = pipe.execute()
        flags = dict(params=json.loads(params) if params else None, done=bool(done),
                     failed=bool(failed), in_flight_here=here is not None, pending=pending,
                     job_gpus=job_gpus, entry_digest=hashlib.sha1(entry or b"").hexdigest())
        if entry and bodies.is_reference(entry):
            return TaskState(messages=None, body_reference=entry, bare_entry=entry,
                             body_location=location.decode() if location else None, **flags)
        decoded = decode_messages(entry) if entry else None
        # A regenerated prompt is stored as {"messages", "continue"?} (reopen.lua), a new one as
        # its bare list of messages; a generation moved or between rounds keeps the reference of
        # a text on storage ("reference"), which the index of rows keeps as the prompt's entry.
        if isinstance(decoded, dict):
            reference = decoded.get("reference")
            return TaskState(messages=decoded["messages"], continuation=decoded.get("continue"),
                             turns=tuple(decoded.get("turns") or ()),
                             bare_entry=reference.encode() if reference else None, **flags)
        return TaskState(messages=decoded, bare_entry=entry or None, **flags)

    def reopen(self, job: JobName, ended: EndedRow, entry: str | bytes,
               continued_tokens: int) -> bool:
        """Take a done prompt back for regeneration (reopen.lua), `entry` becoming its stored
        prompt; False if it was not done, or (read from the index) its newest row is another."""
        return bool(self.reopen_many(job, [(ended, entry, continued_tokens)])[0])

    def reopen_many(self, job: JobName,
                    items: Sequence[tuple[EndedRow, str | bytes, int]]) -> list[bool]:
        """reopen() of each (ended row, entry, continued tokens), in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for ended, entry, continued_tokens in items:
            out = ended.completion_tokens
            REOPEN(pipe, done=job.done, prompts=job.prompts, pending=job.pending,
                   counters=job.counters, ended=job.ended(ended.finish_reason), config=job.config,
                   superseding=job.superseding, id=ended.id, entry=entry,
                   input_tokens=ended.prompt_tokens, output_tokens=out,
                   finish_reason=ended.finish_reason, gpu=ended.gpu,
                   hist_bucket=out // HIST_BUCKET_TOKENS * HIST_BUCKET_TOKENS,
                   continued_tokens=continued_tokens, indexed=ended.indexed, place=ended.entry,
                   looping="1" if ended.looping else "")
        return [bool(done) for done in pipe.execute()]

    def ended_count(self, job: JobName, reason: str) -> tuple[int, int]:
        """(rows in the index of rows that ended `reason`, rows the counters say ended so), read
        together: equal when the index covers the job (complete.lua and reopen.lua change both
        in one step); fewer for a reason not indexed or a job begun before the index."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hlen(job.ended(reason))
        pipe.hget(job.counters, f"finish:{reason}")
        indexed, counted = pipe.execute()
        return int(indexed), int(counted or 0)

    def ended_rows(self, job: JobName, reason: str, *, prompts: bool = True) -> Iterator[EndedRow]:
        """The rows that had ended `reason` when this began, from the index (not the rows): a
        row finished since (a prompt this regenerate took back, done again) is not given again.
        Without `prompts` their messages are left out (a continuation reads them from the row)."""
        try:
            last = self.r.xinfo_stream(job.output)["last-generated-id"]
        except redis.ResponseError:  # no stream: no row was ever finished
            return
        cutoff = entry_order(_s(last))
        for prompt_id, raw in self.r.hscan_iter(job.ended(reason), count=500):
            head, _, prompt = raw.partition(b"\n")
            # A fifth field, "loop", marks a looping row (complete.lua; older records have four).
            entry, prompt_tokens, completion_tokens, gpu, *loop = head.decode().split(" ")
            if entry_order(entry) <= cutoff:
                yield EndedRow(_s(prompt_id), reason, int(prompt_tokens), int(completion_tokens),
                               gpu, entry, prompt if prompts else None, head.decode(),
                               looping=loop == ["loop"])

    # -- outcomes --------------------------------------------------------------------------------

    def complete(self, job: JobName, prompt_id: str, gpu: GpuName, row: dict, *,
                 bare_entry: bytes | None = None, made: tuple[int, float] | None = None,
                 rate_bucket_s: int = 10) -> bool:
        """Record a finished row exactly once. False when it was a duplicate delivery. A
        recalled prompt waiting in pending or on another of the job's GPUs is taken out there.
        `bare_entry` (TaskState's): the prompt's `prompts` entry as the task read it, which the
        index of rows by finish reason keeps instead of the row's messages encoded again.
        `made`: the tokens the last request generated on `gpu` and its seconds, for the GPU's
        speed and the rates (the whole row's, by default: one request made it)."""
        meta = row["metadata"]
        out = int(meta["completion_tokens"])
        reason = meta["finish_reason"]
        # Its prompt, kept in the index for a regenerate that reads no batch (a few KB at most,
        # compressed, for a fifth of the rows at the real run's figures: docs/ARCHITECTURE.md;
        # about 20 bytes when its text stays on storage): the entry as read, or the row's
        # messages encoded again (a regenerated prompt, whose entry holds more).
        prompt = b"" if reason in UNINDEXED_REASONS else \
            bare_entry or encode_messages(row["conversations"][:-1])
        # What this GPU decoded in its last request: a row made in several requests (rounds, a
        # move, a truncated row continued) credits each GPU its own share. A request too short
        # to say how fast the GPU decodes (prefill and the round trip dominate it) does not move
        # its speed.
        tokens, seconds = made if made is not None else (out, float(meta.get("latency_s") or 0))
        speed = f"{tokens / seconds:.1f}" if tokens >= SPEED_MIN_TOKENS and seconds > 0 else ""
        shares = made_by(meta, gpu).partition("/")[2]
        named = dict(
            done=job.done, inflight=job.inflight(gpu), prompts=job.prompts, failed=job.failed,
            counters=job.counters, rate=job.rate, output=job.output, pending=job.pending,
            config=job.config, gpus=job.gpus, ended=job.ended(reason), speed=job.speed,
            superseding=job.superseding, superseded=job.superseded, going_on=job.going_on,
            id=prompt_id,
            row=json.dumps(row, ensure_ascii=False, separators=(",", ":")),
            input_tokens=int(meta["prompt_tokens"]), output_tokens=out, finish_reason=reason,
            gpu=gpu, rate_bucket_s=rate_bucket_s, looping="1" if meta.get("loop") else "",
            hist_bucket=out // HIST_BUCKET_TOKENS * HIST_BUCKET_TOKENS,
            inflight_prefix=job.inflight(""), prompt=prompt, tokens_per_s=speed,
            speed_weight=self.speed_weight, shares=shares, made=tokens)
        if not self.wait_replicas:
            return bool(COMPLETE(self.r, **named))
        # WAIT counts the replicas that have the writes of its own connection: in one pipeline
        # with the script, or it could prove nothing about this row.
        pipe = self.r.pipeline(transaction=False)
        COMPLETE(pipe, **named)
        pipe.wait(self.wait_replicas, self.wait_timeout_ms)
        recorded, replicas = pipe.execute()
        self._check_replicas(replicas, f"prompt {prompt_id}'s row")
        return bool(recorded)

    def fail(self, job: JobName, prompt_id: str, gpu: GpuName, record: dict) -> bool:
        """Enter a prompt in the failed registry. False when it was done or already failed."""
        return bool(FAIL(self.r, done=job.done, inflight=job.inflight(gpu), failed=job.failed,
                         counters=job.counters, failures=job.failures, pending=job.pending,
                         config=job.config, gpus=job.gpus, id=prompt_id,
                         record=json.dumps(record, ensure_ascii=False), gpu=gpu,
                         inflight_prefix=job.inflight("")))

    def note_retry(self, job: JobName, prompt_id: str, gpu: GpuName, reason: str,
                   due: float) -> bool:
        """Count a retry, refresh the prompt's in-flight mark and record it as waiting until
        `due` (Unix time). False when it is already done."""
        return bool(RETRY(self.r, done=job.done, inflight=job.inflight(gpu), counters=job.counters,
                          config=job.config, retrying=job.retrying(gpu), id=prompt_id,
                          reason=reason, gpu=gpu, due=due))

    def requeue_failed(self, job: JobName, records: Sequence[tuple[str, str]]) -> tuple[int, int]:
        """Move failed prompts, given as (id, registry record exactly as read), back to the
        front of pending. Returns (moved, missing); see requeue_failed.lua."""
        moved, missing = REQUEUE_FAILED(self.r, config=job.config, failed=job.failed,
                                        pending=job.pending, done=job.done, prompts=job.prompts,
                                        counters=job.counters,
                                        items=[x for pair in records for x in pair])
        return int(moved), int(missing)

    def finish(self, job: JobName) -> str:
        """Mark a running job done if, in this very step, every prompt has its outcome and
        nothing waits anywhere (finish.lua). Returns "done", or what still holds it."""
        return _s(FINISH(self.r, config=job.config, counters=job.counters, pending=job.pending,
                         output=job.output, sealing=job.sealing, gpus=job.gpus,
                         inflight_prefix=job.inflight("")))

    def transition(self, job: JobName, expect: str, status: str) -> bool:
        """Set the job's status to `status` only if it is still `expect`: a command checked
        against the state it read never overwrites a change made since (a pause racing beat's
        done, an enqueue). False when it changed; nothing is written then."""
        if status not in STATES:
            raise ValueError(f"unknown status {status!r}; one of {', '.join(STATES)}")
        return not self.update_job(job, {"status": [expect]}, {"status": status})

    def update_job(self, job: JobName, expect: dict[str, Iterable[str]],
                   changes: dict[str, str]) -> dict[str, str]:
        """Write `changes` into the job's config only if each field in `expect` still holds one
        of its values ("" for absent), in one step (update_job.lua). Returns {} when written,
        else {field: its value now} for each field that differed (nothing is written then)."""
        fields: list = []
        for field, allowed in expect.items():
            fields += [field, json.dumps(list(allowed))]
        for field, value in changes.items():
            fields += [field, value]
        wrong = UPDATE_JOB(self.r, config=job.config, checked=len(expect), fields=fields)
        return {_s(wrong[i]): _s(wrong[i + 1]) for i in range(0, len(wrong), 2)}

    def failed_records(self, job: JobName) -> Iterable[tuple[str, str]]:
        """(id, raw record JSON) for every prompt in the failed registry, by HSCAN."""
        for prompt_id, raw in self.r.hscan_iter(job.failed, count=1000):
            yield _s(prompt_id), _s(raw)

    def replicate_sealing(self, job: JobName, intent: str) -> None:
        """Before a batch ships, with wait_replicas: wait until the replicas have every write so
        far, the batch's rows among them (beat may have read a row before its task's WAIT). The
        intent is written again, unchanged, because WAIT counts its own connection's writes."""
        if not self.wait_replicas:
            return
        pipe = self.r.pipeline(transaction=False)
        pipe.set(job.sealing, intent, xx=True)
        pipe.wait(self.wait_replicas, self.wait_timeout_ms)
        self._check_replicas(pipe.execute()[-1], f"job {job}'s batch")

    def replicated(self, job: JobName, what: str) -> bool:
        """With wait_replicas: whether the replicas have every write made so far (one write on
        this connection, then WAIT: replication is ordered, so it covers every earlier write of
        any connection). True without wait_replicas. A local file whose only other record is
        such a write (a spooled batch, once shipped) is removed only when this says True."""
        if not self.wait_replicas:
            return True
        pipe = self.r.pipeline(transaction=False)
        pipe.hincrby(job.counters, "spooled", 0)  # a write, changing nothing
        pipe.wait(self.wait_replicas, self.wait_timeout_ms)
        replicas = pipe.execute()[-1]
        self._check_replicas(replicas, what)
        return replicas >= self.wait_replicas

    def _check_replicas(self, replicas: int, what: str) -> None:
        """Fewer replicas than asked within the timeout: the write stands on the master alone
        (a failover now may lose it; the ledger recovers it then, docs/WHEN_THINGS_FAIL.md). Go
        on, and say so once a minute: a replica down must not stop the run."""
        if replicas >= self.wait_replicas:
            return
        now = time.monotonic()
        if now - self._lagging_warned_at >= LAGGING_WARN_EVERY_S:
            self._lagging_warned_at = now
            log.warning("%s reached %d of %d replica(s) within %d ms (DFLASH_REDIS_WAIT_REPLICAS): "
                        "a failover now could lose it; is a replica down or behind?", what,
                        replicas, self.wait_replicas, self.wait_timeout_ms)

    # -- reading ---------------------------------------------------------------------------------

    def counters(self, job: JobName) -> dict[str, int]:
        raw = self.r.hgetall(job.counters)
        return {_s(k): int(v) for k, v in raw.items()}


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def ledger_for(r: redis.Redis, s: Settings) -> Ledger:
    """A Ledger on r that waits for s's replicas."""
    return Ledger(r, wait_replicas=s.redis_wait_replicas, wait_timeout_ms=s.redis_wait_timeout_ms,
                  speed_weight=s.speed_average_weight)


@lru_cache(maxsize=1)
def shared_ledger() -> Ledger:
    """The process's Ledger, on its Redis client."""
    return ledger_for(redis_client(), get_settings())
