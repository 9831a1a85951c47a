"""The books in Redis: a job's prompts, dispatch windows, done marks, counters and output rows,
plus the compare-and-set steps of batch sealing and of training runs.

Every Lua script of the project is a file beside this one, so each multi-step change is atomic
and reviewable on its own; this module alone registers them and names the keys each one touches.
`messages` is the stored form of a prompt's conversation.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import redis

from dflash_tasks.core.connections import redis_client
from dflash_tasks.core.jobs import JobDeleted
from dflash_tasks.core.keys import (
    BREAKERS,
    MEMORY_HOLD,
    MIGRATIONS,
    WORKERS,
    WORKERS_SEEN,
    JobKeys,
    queue_for,
)
from dflash_tasks.core.lifecycle import STATES
from dflash_tasks.core.settings import Settings, get_settings
from dflash_tasks.ledger import bodies
from dflash_tasks.ledger.messages import decode_messages, encode_messages

log = logging.getLogger(__name__)
_HERE = Path(__file__).parent
LAGGING_WARN_EVERY_S = 60.0
HIST_BUCKET_TOKENS = 64   # output-length histogram resolution, for percentiles without scans
SPEED_MIN_TOKENS = 64     # the shortest request that counts for its GPU's speed (take.lua)
# Rows that ended "stop" are most of a job and rarely generated again: they are not in the index
# of rows by finish reason (regenerate reads the batches to find them). Every other reason is.
UNINDEXED_REASONS = frozenset({"stop"})


@dataclass(frozen=True, slots=True)
class TaskState:
    """What a generate task needs, read in one round trip."""
    params: dict | None
    messages: list[dict] | None
    done: bool
    failed: bool = False  # in the failed registry: parked until `manage.py retry-failed`
    continuation: dict | None = None  # a truncated output to continue (regenerate --continue)
    # Dispatched to this GPU and not recalled since (a message of a recalled prompt is stale).
    in_flight_here: bool = True
    # A body kept on storage (bodies.py): `messages` is None, and the task reads it from there.
    body_reference: bytes | None = None
    body_location: str | None = None
    # The `prompts` entry as read, when it is the prompt alone (its messages' frame, or a
    # reference), not the {messages, continue} of a regenerated one: the index of rows by finish
    # reason keeps it as it is (Ledger.complete).
    bare_entry: bytes | None = None

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
            return replace(self, messages=decoded["messages"], continuation=decoded.get("continue"),
                           bare_entry=None)
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
    gpu: str
    # The row's stream entry id: in the stream until sealed, then in the batch whose first entry
    # is the last one at or before it (batches are consecutive runs of the stream).
    entry: str = ""
    prompt: bytes | None = None  # its messages as `prompts` stores them (encode_messages)
    # The index record's first line as read: reopen.lua takes the row back only while it is
    # still that one. Empty for a row read from a batch.
    indexed: str = ""

    @classmethod
    def from_row(cls, row: dict) -> "EndedRow":
        meta = row["metadata"]
        return cls(row["id"], meta["finish_reason"], int(meta["prompt_tokens"]),
                   int(meta["completion_tokens"]), meta["gpu"])


def entry_order(entry: str) -> tuple[int, int]:
    """A stream entry id ("<ms>-<seq>") as a sortable pair."""
    ms, _, seq = entry.partition("-")
    return int(ms), int(seq or 0)


class Ledger:
    def __init__(self, client: redis.Redis, *, wait_replicas: int = 0, wait_timeout_ms: int = 1000):
        self.r = client
        # Settings.redis_wait_replicas: rows (and batches) wait until the replicas have them.
        self.wait_replicas, self.wait_timeout_ms = wait_replicas, wait_timeout_ms
        self._lagging_warned_at = -LAGGING_WARN_EVERY_S
        prelude = {"complete": "elsewhere", "fail": "elsewhere"}  # Lua functions they call
        self._scripts = {
            name: client.register_script("".join(
                (_HERE / f"{part}.lua").read_text() for part in (prelude.get(name), name) if part))
            for name in ("unknown_ids", "add_prompts", "take", "complete", "fail", "record_batch", "retry",
                         "requeue_failed", "reopen", "recall", "drop_sealed", "clear_sealing",
                         "ship_spooled", "finish", "update_job", "drop_settled", "claim_gpu",
                         "hand_over",
                         "train_run_set")}

    # -- enqueue ---------------------------------------------------------------------------------

    def add_prompts(self, job: str, prompts: Sequence[tuple[str, str]]) -> int:
        """Store (id, messages_json) pairs not seen before and queue them; returns how many.
        Raises JobDeleted when the job was deleted meanwhile (nothing is stored then)."""
        k = JobKeys(job)
        argv = [x for pair in prompts for x in pair]
        added = int(self._scripts["add_prompts"](
            keys=[k.prompts, k.pending, k.done, k.counters, k.config], args=argv))
        if added < 0:
            raise JobDeleted(f"job {job} was deleted while its prompts were being stored")
        return added

    def unknown_positions(self, job: str, ids: Sequence[str]) -> list[int]:
        """The 0-based positions of the ids the job neither stores nor has done (a resumed
        enqueue sends only those prompts' messages)."""
        k = JobKeys(job)
        return [i - 1 for i in self._scripts["unknown_ids"](keys=[k.prompts, k.done], args=list(ids))]

    # -- dispatch --------------------------------------------------------------------------------

    def take(self, job: str, gpu: str, window: int, *, task: str, origin: str,
             reply_to: str, alive_s: float = 180) -> list[str]:
        """Top gpu's window up from pending and publish a `task` message per id taken onto its
        queue, in one call; at the end of the run, steal from the job's other GPUs (take.lua).
        Nothing when the job's GPU selection does not allow `gpu`, nor while dispatch is held
        (the job's batches can go nowhere, or Redis is near its maxmemory), nor, at the very end
        of the run, on a GPU measurably slower than others that are alive and will free a slot
        sooner (take.lua; a heartbeat older than `alive_s` is not alive). Returns the ids taken."""
        k = JobKeys(job)
        ids = self._scripts["take"](keys=[k.config, k.pending, k.inflight(gpu), k.gpus, queue_for(gpu),
                                          k.hold, MEMORY_HOLD, k.speed, WORKERS_SEEN, WORKERS,
                                          BREAKERS, k.migrating],
                                    args=[window, job, gpu, task, origin, reply_to, k.inflight(""),
                                          alive_s, MIGRATIONS, k.retrying("")])
        return [i.decode() if isinstance(i, bytes) else i for i in ids]

    def task_state(self, job: str, prompt_id: str, gpu: str) -> TaskState:
        k = JobKeys(job)
        pipe = self.r.pipeline(transaction=False)
        pipe.hmget(k.config, "params", "bodies")
        pipe.hget(k.prompts, prompt_id)
        pipe.sismember(k.done, prompt_id)
        pipe.hexists(k.failed, prompt_id)
        pipe.zscore(k.inflight(gpu), prompt_id)
        pipe.zrem(k.retrying(gpu), prompt_id)  # running now: its retry no longer waits
        (params, location), entry, done, failed, here, _ = pipe.execute()
        flags = dict(params=json.loads(params) if params else None, done=bool(done),
                     failed=bool(failed), in_flight_here=here is not None)
        if entry and bodies.is_reference(entry):
            return TaskState(messages=None, body_reference=entry, bare_entry=entry,
                             body_location=location.decode() if location else None, **flags)
        decoded = decode_messages(entry) if entry else None
        # A regenerated prompt is stored as {"messages", "continue"?} (reopen.lua), a new one as
        # its bare list of messages.
        if isinstance(decoded, dict):
            return TaskState(messages=decoded["messages"], continuation=decoded.get("continue"),
                             **flags)
        return TaskState(messages=decoded, bare_entry=entry or None, **flags)

    def reopen(self, job: str, ended: EndedRow, entry: str | bytes, continued_tokens: int) -> bool:
        """Take a done prompt back for regeneration (reopen.lua), `entry` becoming its stored
        prompt; False if it was not done, or (read from the index) its newest row is another."""
        return bool(self.reopen_many(job, [(ended, entry, continued_tokens)])[0])

    def reopen_many(self, job: str,
                    items: Sequence[tuple[EndedRow, str | bytes, int]]) -> list[bool]:
        """reopen() of each (ended row, entry, continued tokens), in one round trip."""
        k = JobKeys(job)
        pipe = self.r.pipeline(transaction=False)
        for ended, entry, continued_tokens in items:
            out = ended.completion_tokens
            self._scripts["reopen"](
                keys=[k.done, k.prompts, k.pending, k.counters, k.ended(ended.finish_reason),
                      k.config, k.superseding],
                args=[ended.id, entry, ended.prompt_tokens, out, ended.finish_reason, ended.gpu,
                      out // HIST_BUCKET_TOKENS * HIST_BUCKET_TOKENS, continued_tokens,
                      ended.indexed, ended.entry], client=pipe)
        return [bool(done) for done in pipe.execute()]

    def ended_count(self, job: str, reason: str) -> tuple[int, int]:
        """(rows in the index of rows that ended `reason`, rows the counters say ended so), read
        together: equal when the index covers the job (complete.lua and reopen.lua change both
        in one step); fewer for a reason not indexed or a job begun before the index."""
        k = JobKeys(job)
        pipe = self.r.pipeline(transaction=True)
        pipe.hlen(k.ended(reason))
        pipe.hget(k.counters, f"finish:{reason}")
        indexed, counted = pipe.execute()
        return int(indexed), int(counted or 0)

    def ended_rows(self, job: str, reason: str, *, prompts: bool = True) -> Iterator[EndedRow]:
        """The rows that had ended `reason` when this began, from the index (not the rows): a
        row finished since (a prompt this regenerate took back, done again) is not given again.
        Without `prompts` their messages are left out (a continuation reads them from the row)."""
        k = JobKeys(job)
        try:
            last = self.r.xinfo_stream(k.output)["last-generated-id"]
        except redis.ResponseError:  # no stream: no row was ever finished
            return
        cutoff = entry_order(_s(last))
        for prompt_id, raw in self.r.hscan_iter(k.ended(reason), count=500):
            head, _, prompt = raw.partition(b"\n")
            entry, prompt_tokens, completion_tokens, gpu = head.decode().split(" ")
            if entry_order(entry) <= cutoff:
                yield EndedRow(_s(prompt_id), reason, int(prompt_tokens), int(completion_tokens),
                               gpu, entry, prompt if prompts else None, head.decode())

    def migration_target(self, job: str, prompt_id: str, gpu: str) -> str | None:
        """The GPU take.lua ordered this prompt's generation on `gpu` moved to, if any."""
        order = self.r.hget(JobKeys(job).migrating, prompt_id)
        if order is None:
            return None
        source, target, _ = order.decode().split(" ")
        return target if source == gpu else None

    def hand_over(self, job: str, prompt_id: str, source: str, target: str | None,
                  entry: bytes, tokens: int) -> bool:
        """Move a generation aborted on `source` to `target` (None: the front of pending), its
        entry now the one that goes on from its partial output (hand_over.lua). False when the
        order changed or the prompt left `source` meanwhile (nothing moved)."""
        k = JobKeys(job)
        return bool(self._scripts["hand_over"](
            keys=[k.migrating, k.inflight(source), k.inflight(target or source), k.prompts,
                  k.pending, k.counters, k.config],
            args=[prompt_id, entry, source, target or "", tokens]))

    def migrations(self, gpu: str, timeout_s: float) -> tuple[str, str] | None:
        """The next (job, prompt id) whose generation on `gpu` is to be handed over, waiting up
        to timeout_s for one (take.lua pushes them)."""
        got = self.r.blpop([MIGRATIONS + gpu], timeout=timeout_s)
        if got is None:
            return None
        job, _, prompt_id = got[1].decode().partition("\n")
        return job, prompt_id

    def recall(self, job: str, gpu: str, ids: Sequence[str] = ()) -> int:
        """Put prompts in flight on `gpu` (`ids`, or all) back in front of pending (recall.lua)."""
        k = JobKeys(job)
        return int(self._scripts["recall"](keys=[k.inflight(gpu), k.pending, k.done], args=list(ids)))

    def drop_settled(self, job: str, gpu: str, prompt_id: str) -> bool:
        """Take a prompt that has its outcome (done, failed) or left the job out of gpu's
        in-flight set, checked in the same step (drop_settled.lua): one taken back and
        dispatched here again since the caller looked keeps its fresh entry. True when removed."""
        k = JobKeys(job)
        return bool(self._scripts["drop_settled"](
            keys=[k.inflight(gpu), k.done, k.failed, k.prompts], args=[prompt_id]))

    def restamp_inflight(self, job: str, gpu: str, ids: Sequence[str], at: float) -> None:
        """Dispatched again now (the reaper): their in-flight time restarts; an id that left the
        set meanwhile (its outcome arrived) is not put back."""
        if ids:
            self.r.zadd(JobKeys(job).inflight(gpu), {i: at for i in ids}, xx=True)

    # -- outcomes --------------------------------------------------------------------------------

    def complete(self, job: str, prompt_id: str, gpu: str, row: dict, *,
                 bare_entry: bytes | None = None, rate_bucket_s: int = 10) -> bool:
        """Record a finished row exactly once. False when it was a duplicate delivery. A
        recalled prompt waiting in pending or on another of the job's GPUs is taken out there.
        `bare_entry` (TaskState's): the prompt's `prompts` entry as the task read it, which the
        index of rows by finish reason keeps instead of the row's messages encoded again."""
        k = JobKeys(job)
        meta = row["metadata"]
        out = int(meta["completion_tokens"])
        reason = meta["finish_reason"]
        keys = [k.done, k.inflight(gpu), k.prompts, k.failed, k.counters, k.rate, k.output,
                k.pending, k.config, k.gpus, k.ended(reason), k.speed, k.superseding, k.superseded]
        # Its prompt, kept in the index for a regenerate that reads no batch (a few KB at most,
        # compressed, for a fifth of the rows at the real run's figures: docs/ARCHITECTURE.md;
        # about 20 bytes when its text stays on storage): the entry as read, or the row's
        # messages encoded again (a regenerated prompt, whose entry holds more).
        prompt = b"" if reason in UNINDEXED_REASONS else \
            bare_entry or encode_messages(row["conversations"][:-1])
        latency = float(meta.get("latency_s") or 0)
        # What this GPU decoded in that time: a continued row's first tokens came from another
        # request (a truncated row, a generation moved here). A request too short to say how
        # fast the GPU decodes (prefill and the round trip dominate it) does not move its speed.
        made = out - int(meta.get("continued_tokens") or 0)
        speed = f"{made / latency:.1f}" if made >= SPEED_MIN_TOKENS and latency > 0 else ""
        args = [prompt_id, json.dumps(row, ensure_ascii=False, separators=(",", ":")),
                int(meta["prompt_tokens"]), out, reason, gpu, rate_bucket_s,
                out // HIST_BUCKET_TOKENS * HIST_BUCKET_TOKENS, k.inflight(""), prompt, speed]
        if not self.wait_replicas:
            return bool(self._scripts["complete"](keys=keys, args=args))
        # WAIT counts the replicas that have the writes of its own connection: in one pipeline
        # with the script, or it could prove nothing about this row.
        pipe = self.r.pipeline(transaction=False)
        self._scripts["complete"](keys=keys, args=args, client=pipe)
        pipe.wait(self.wait_replicas, self.wait_timeout_ms)
        recorded, replicas = pipe.execute()
        self._check_replicas(replicas, f"prompt {prompt_id}'s row")
        return bool(recorded)

    def fail(self, job: str, prompt_id: str, gpu: str, record: dict) -> bool:
        """Enter a prompt in the failed registry. False when it was done or already failed."""
        k = JobKeys(job)
        return bool(self._scripts["fail"](
            keys=[k.done, k.inflight(gpu), k.failed, k.counters, k.failures, k.pending, k.config,
                  k.gpus],
            args=[prompt_id, json.dumps(record, ensure_ascii=False), gpu, k.inflight("")]))

    def note_retry(self, job: str, prompt_id: str, gpu: str, reason: str, due: float) -> bool:
        """Count a retry, refresh the prompt's in-flight mark and record it as waiting until
        `due` (Unix time). False when it is already done."""
        k = JobKeys(job)
        return bool(self._scripts["retry"](
            keys=[k.done, k.inflight(gpu), k.counters, k.config, k.retrying(gpu)],
            args=[prompt_id, reason, gpu, due]))

    def requeue_failed(self, job: str, records: Sequence[tuple[str, str]]) -> tuple[int, int]:
        """Move failed prompts, given as (id, registry record exactly as read), back to the
        front of pending. Returns (moved, missing); see requeue_failed.lua."""
        k = JobKeys(job)
        argv = [x for pair in records for x in pair]
        moved, missing = self._scripts["requeue_failed"](
            keys=[k.config, k.failed, k.pending, k.done, k.prompts, k.counters], args=argv)
        return int(moved), int(missing)

    def finish(self, job: str) -> str:
        """Mark a running job done if, in this very step, every prompt has its outcome and
        nothing waits anywhere (finish.lua). Returns "done", or what still holds it."""
        k = JobKeys(job)
        return _s(self._scripts["finish"](
            keys=[k.config, k.counters, k.pending, k.output, k.sealing, k.gpus],
            args=[k.inflight("")]))

    def transition(self, job: str, expect: str, status: str) -> bool:
        """Set the job's status to `status` only if it is still `expect`: a command checked
        against the state it read never overwrites a change made since (a pause racing beat's
        done, an enqueue). False when it changed; nothing is written then."""
        if status not in STATES:
            raise ValueError(f"unknown status {status!r}; one of {', '.join(STATES)}")
        return not self.update_job(job, {"status": [expect]}, {"status": status})

    def update_job(self, job: str, expect: dict[str, Iterable[str]],
                   changes: dict[str, str]) -> dict[str, str]:
        """Write `changes` into the job's config only if each field in `expect` still holds one
        of its values ("" for absent), in one step (update_job.lua). Returns {} when written,
        else {field: its value now} for each field that differed (nothing is written then)."""
        argv: list = [len(expect)]
        for field, allowed in expect.items():
            argv += [field, json.dumps(list(allowed))]
        for field, value in changes.items():
            argv += [field, value]
        wrong = self._scripts["update_job"](keys=[JobKeys(job).config], args=argv)
        return {_s(wrong[i]): _s(wrong[i + 1]) for i in range(0, len(wrong), 2)}

    def failed_records(self, job: str) -> Iterable[tuple[str, str]]:
        """(id, raw record JSON) for every prompt in the failed registry, by HSCAN."""
        for prompt_id, raw in self.r.hscan_iter(JobKeys(job).failed, count=1000):
            yield _s(prompt_id), _s(raw)

    def record_batch(self, job: str, name: str, record: dict, stats: dict[str, int] | None = None) -> bool:
        """Enter a batch in the manifest; `stats` (counter -> increment) is added with it, once."""
        k = JobKeys(job)
        extra = [x for field, inc in (stats or {}).items() for x in (field, int(inc))]
        return bool(self._scripts["record_batch"](keys=[k.manifest, k.counters],
                                                  args=[name, json.dumps(record), record["bytes"], *extra]))

    def ship_spooled(self, job: str, name: str, spooled: str, shipped: str,
                     counts: dict[str, int]) -> bool:
        """A spooled batch is in the storage now: its manifest record `spooled` (as read)
        becomes `shipped`, and `counts` are added, once (ship_spooled.lua)."""
        k = JobKeys(job)
        extra = [x for field, inc in counts.items() for x in (field, int(inc))]
        return bool(self._scripts["ship_spooled"](keys=[k.manifest, k.counters],
                                                  args=[name, spooled, shipped, *extra]))

    def replicate_sealing(self, job: str, intent: str) -> None:
        """Before a batch ships, with wait_replicas: wait until the replicas have every write so
        far, the batch's rows among them (beat may have read a row before its task's WAIT). The
        intent is written again, unchanged, because WAIT counts its own connection's writes."""
        if not self.wait_replicas:
            return
        pipe = self.r.pipeline(transaction=False)
        pipe.set(JobKeys(job).sealing, intent, xx=True)
        pipe.wait(self.wait_replicas, self.wait_timeout_ms)
        self._check_replicas(pipe.execute()[-1], f"job {job}'s batch")

    def replicated(self, job: str, what: str) -> bool:
        """With wait_replicas: whether the replicas have every write made so far (one write on
        this connection, then WAIT: replication is ordered, so it covers every earlier write of
        any connection). True without wait_replicas. A local file whose only other record is
        such a write (a spooled batch, once shipped) is removed only when this says True."""
        if not self.wait_replicas:
            return True
        pipe = self.r.pipeline(transaction=False)
        pipe.hincrby(JobKeys(job).counters, "spooled", 0)  # a write, changing nothing
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

    def drop_sealed(self, job: str, entry_ids: Sequence[bytes | str], nbytes: int) -> int:
        """Remove a shipped batch's entries (their rows: `nbytes`, each with its newline) from
        the output stream, with their share of the unsealed counters (drop_sealed.lua)."""
        k = JobKeys(job)
        return int(self._scripts["drop_sealed"](keys=[k.output, k.counters],
                                                args=[nbytes, *entry_ids]))

    def clear_sealing(self, job: str, intent: str) -> bool:
        """Clear the job's sealing intent if it is still `intent` (batches.py's last step)."""
        return bool(self._scripts["clear_sealing"](keys=[JobKeys(job).sealing], args=[intent]))

    # -- workers ---------------------------------------------------------------------------------

    def claim_gpu(self, gpu: str, registration: str, fresh_s: float, *,
                  release: bool = False) -> str:
        """Register this worker for `gpu` and stamp its heartbeat, unless another holds the name
        with a heartbeat younger than fresh_s (claim_gpu.lua); with `release`, remove the stamp
        if it is ours. Returns "" when done, else the holder's registration JSON."""
        return _s(self._scripts["claim_gpu"](
            keys=[WORKERS, WORKERS_SEEN],
            args=[queue_for(gpu), registration, fresh_s, "release" if release else "claim"]))

    # -- training runs ---------------------------------------------------------------------------

    def set_train_run_if(self, run_key: str, args: list) -> str | None:
        """train_run_set.lua on a run's hash (training/queue/runs.py builds `args`): the status
        the run had, or None when it was not in an allowed state or not owned as required."""
        old = self._scripts["train_run_set"](keys=[run_key], args=args)
        return old.decode() if old else None

    # -- reading ---------------------------------------------------------------------------------

    def counters(self, job: str) -> dict[str, int]:
        raw = self.r.hgetall(JobKeys(job).counters)
        return {_s(k): int(v) for k, v in raw.items()}


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def ledger_for(r: redis.Redis, s: Settings) -> Ledger:
    """A Ledger on r that waits for s's replicas."""
    return Ledger(r, wait_replicas=s.redis_wait_replicas, wait_timeout_ms=s.redis_wait_timeout_ms)


@lru_cache(maxsize=1)
def shared_ledger() -> Ledger:
    """The process's Ledger, on its Redis client."""
    return ledger_for(redis_client(), get_settings())
