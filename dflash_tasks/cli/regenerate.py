"""`regenerate`: run again the prompts whose newest row ended a given way (typically truncated
under an old cap), optionally continuing their output instead of starting over.

The rows are found through the ledger's index of rows by finish reason (complete.lua keeps it
with the done mark), so the cost follows the rows taken back, not the job: a plain regenerate
reads no batch (the index holds each row's prompt and its share of the counters), and
`--continue` reads only the batches that hold the rows it continues (their token ids). A
reason the index does not hold ("stop"), or a job begun before it, is found by reading every
batch, as the command says when it does."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

import click

from dflash_tasks.cli.common import (
    MAX_OUTPUT_TOKENS,
    allowed_or_fail,
    console,
    job_option,
    job_or_fail,
    redis_or_fail,
)
from dflash_tasks.core.keys import JobName
from dflash_tasks.core.settings import get_settings
from dflash_tasks.ledger.messages import compress_messages_json

# Rows taken back per round trip, and per chunk object of continuations (bodies.ChunkWriter).
SLICE = 1000


@dataclass
class Tally:
    """What this regenerate has taken back so far, up to its limit. A row to continue keeps its
    prefix (its token ids and texts, ~50 KB) out of Redis: its entry goes to a chunk object on
    the job's body storage (`store`, as `enqueue --bodies storage` does), and Redis gets a
    reference of about 25 bytes, which the task resolves when it runs. Rows are taken back a
    slice at a time, each slice in one round trip, its chunk written first."""
    limit: int | None
    store: Callable[[list[bytes]], list[bytes]] | None = None
    reopened: int = 0
    continued: int = 0
    saved: int = 0  # output tokens a continuation keeps instead of generating again
    _slice: list = field(default_factory=list)

    def full(self) -> bool:
        return bool(self.limit) and self.reopened + len(self._slice) >= self.limit

    def reopen(self, book, job: JobName, ended, entry: dict | bytes) -> None:
        """Take `ended` back with `entry` as its stored prompt: the messages as `prompts`
        stores them (from the index), or {messages, continue?} (from the row)."""
        kept = 0
        if isinstance(entry, dict):
            kept = len(entry["continue"]["response_ids"]) if "continue" in entry else 0
            entry = compress_messages_json(json.dumps(
                entry, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
        self._slice.append((ended, entry, kept))
        if len(self._slice) >= SLICE:
            self.flush(book, job)

    def flush(self, book, job: JobName) -> None:
        """Take the slice back: its continuations' chunk written first, then one round trip."""
        if not self._slice:
            return
        items, self._slice = self._slice, []
        kept_ids = [i for i, (_, _, kept) in enumerate(items) if kept]
        if kept_ids and self.store is not None:
            refs = self.store([items[i][1] for i in kept_ids])
            for i, ref in zip(kept_ids, refs):
                items[i] = (items[i][0], ref, items[i][2])
        for (_, _, kept), done in zip(items, book.reopen_many(job, items)):
            if done:
                self.reopened += 1
                self.continued += bool(kept)
                self.saved += kept


# What SGLang says of a finished request; a job's counters may hold others (its `finish:*`).
FINISH_REASONS = ("length", "stop")


def _check_finish_reason(counters: dict, reason: str) -> None:
    """A reason no row can have is a typo (`lenght` would queue nothing and exit 0): refused
    with the reasons this job's rows have, and the nearest one."""
    import difflib

    seen = {k.split(":", 1)[1]: v for k, v in counters.items() if k.startswith("finish:")}
    known = sorted(set(FINISH_REASONS) | set(seen))
    if reason in known:
        return
    near = difflib.get_close_matches(reason, known, n=1)
    rows = ", ".join(f"{k} {seen.get(k, 0):,}" for k in known)
    raise click.BadParameter(f"{reason!r} is not a finish reason"
                             + (f" (did you mean {near[0]!r}?)" if near else "")
                             + f"; this job's rows ended: {rows}", param_hint="--finish-reason")


@click.command()
@job_option
@click.option("--finish-reason", required=True,
              help="Rows that ended this way: length (cut by max_tokens), stop, or another reason "
                   "the job's rows have (status lists them).")
@click.option("--continue", "continue_output", is_flag=True,
              help="Continue truncated outputs from their token ids (SGLang /generate) instead of "
                   "starting over: only the missing tokens are generated.")
@click.option("--limit", type=click.IntRange(min=1), help="At most N prompts.")
def regenerate(name: JobName, finish_reason: str, continue_output: bool, limit: int | None) -> None:
    """Generate again the prompts whose row ended with FINISH_REASON. The new row replaces the
    old one (readers keep the newest row per id); counters and progress.json follow."""
    from dflash_tasks import dispatch
    from dflash_tasks.core import jobs
    from dflash_tasks.ledger import shared_ledger
    from dflash_tasks.output.batches import BadManifest, RowNotFound
    from dflash_tasks.output.spool import Spool
    from dflash_tasks.output.storage import StorageError, job_output
    from dflash_tasks.tasks.app import app

    r = redis_or_fail()
    job = job_or_fail(r, name)
    allowed_or_fail("regenerate", job)
    s = get_settings()
    book = shared_ledger()
    storage = job_output(job, s)
    # Batches wait in beat's spool while S3 is out (a directory storage has none).
    spool = Spool(s.spool_path()) if getattr(storage, "is_remote", False) else None
    cap = job.params.max_tokens
    _check_finish_reason(book.counters(name), finish_reason)
    indexed, counted = book.ended_count(name, finish_reason)
    _check_memory(r, s, min(limit or counted, counted))
    tally = Tally(limit, store=_continuation_store(r, s, name) if continue_output else None)
    try:
        if indexed != counted:
            console.print(_why_every_batch(name, finish_reason, indexed, counted))
            _from_every_batch(book, r, storage, spool, name, finish_reason, continue_output, cap,
                              tally)
        elif continue_output and finish_reason == "length":
            _continue_from_index(book, r, storage, spool, name, cap, tally)
        else:  # only a truncated row is continued: the others start over, from the index alone
            for ended in book.ended_rows(name, finish_reason):
                tally.reopen(book, name, ended, ended.prompt)
                if tally.full():
                    break
        tally.flush(book, name)
        failure = None
    except (StorageError, RowNotFound, BadManifest) as exc:
        # The rows taken so far are queued again (the job runs them like any other); running it
        # again once the storage answers takes the rest: a prompt already taken back is no
        # longer done, so it is not taken twice. (A slice whose chunk could not be written is
        # not taken back.)
        failure = exc
    if tally.reopened:
        from dflash_tasks.training.data.monitor import restart_window

        restart_window(r, name)  # its facts of the rows just superseded would still count
    # A done job runs again in the step that took each row back (reopen.lua).
    now = jobs.load(r, name)  # None: deleted meanwhile
    if tally.reopened and now is not None and now.status == "running":
        dispatch.topup_all(app, book, s, now)
    if failure is not None:
        raise click.ClickException(
            f"{failure}; {tally.reopened:,} prompts were queued again before it: run the same "
            "command again once the storage answers")
    console.print(f"job {name}: {tally.reopened:,} prompts with finish_reason {finish_reason!r} "
                  f"queued again at max_tokens {cap:,}")
    if continue_output:
        console.print(f"  {tally.continued:,} continue from their truncated output: "
                      f"{tally.saved:,} tokens reused, not generated again")
        if tally.reopened > tally.continued:
            console.print(f"  {tally.reopened - tally.continued:,} start over "
                          "(no token ids in the row)")


# Redis that taking a row back adds, at most: its id in pending, the place of the row it
# replaces (superseding), the prompts entry's reference and the hash entries' overhead. The
# prompt itself moves from the index of rows by finish reason to `prompts` (no more than it
# took), and a continuation's prefix goes to storage (tests/test_regenerate_index.py measures).
REOPEN_BYTES = 300


def _check_memory(r, s, rows: int) -> None:
    """Refuse, before anything changes, a regenerate whose rows would take Redis past the point
    where dispatch is held (DFLASH_REDIS_MEMORY_HOLD_RATIO of its maxmemory)."""
    info = r.info("memory")
    used, limit = int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))
    need = rows * REOPEN_BYTES
    if limit and used + need > s.redis_memory_hold_ratio * limit:
        raise click.ClickException(
            f"taking back {rows:,} rows would add about {need / 1e6:,.1f} MB to Redis, which uses "
            f"{used / 1e6:,.1f} MB of its maxmemory {limit / 1e6:,.1f} MB (dispatch is held at "
            f"{s.redis_memory_hold_ratio:.0%}): nothing was changed; raise maxmemory (CONFIG SET "
            "maxmemory, and REDIS_MAXMEMORY for the next start) or take fewer with --limit")


def _continuation_store(r, s, name: JobName):
    """Where the entries of the rows to continue go: chunk objects under the job's body location
    (its own, or the deployment's storage, which becomes the job's), read back by the task."""
    from dflash_tasks.ledger.bodies import ChunkWriter, job_location
    from dflash_tasks.output.storage import storage_at

    location = job_location(r, name, s)
    return ChunkWriter(r, name, location, storage_at(location, s))


def _refuse_capped(name: str, prompt_id: str, tokens: int, cap: int) -> None:
    raised = min(2 * max(cap, tokens), MAX_OUTPUT_TOKENS)
    raise click.UsageError(
        f"row {prompt_id} already has {tokens:,} tokens and the job's max_tokens is {cap:,}: "
        f"raise it first (to twice that: `manage.py set --job {name} --max-output-tokens "
        f"{raised}`), then continue")


def _continue_from_index(book, r, storage, spool, name: JobName, cap: int, tally: Tally) -> None:
    """Truncated rows continued from their token ids: the index finds them and says where each
    is; only the batches holding them are read, each once, oldest first."""
    from dflash_tasks.output.batches import rows_at
    from dflash_tasks.sglang.ongoing import entry_from_row

    truncated = {ended.id: ended for ended in book.ended_rows(name, "length", prompts=False)}
    for ended in truncated.values():  # refused before anything is taken back
        if ended.completion_tokens >= cap:
            _refuse_capped(name, ended.id, ended.completion_tokens, cap)
    places = [(ended.entry, ended.id) for ended in truncated.values()]
    for prompt_id, row in rows_at(r, storage, name, places, spool=spool):
        tally.reopen(book, name, truncated[prompt_id],
                    entry_from_row(row, continue_output=True, cap=cap))
        if tally.full():
            break


def _why_every_batch(name: str, reason: str, indexed: int, counted: int) -> str:
    from dflash_tasks.ledger import UNINDEXED_REASONS

    if reason in UNINDEXED_REASONS:
        why = f"rows that ended {reason!r} are most of a job and not indexed"
    else:
        why = (f"the ledger's index holds {indexed:,} of the {counted:,} rows that ended "
               f"{reason!r} (rows recorded by a version before it)")
    return (f"job {name}: {why}: reading every batch to find them, which takes as long as "
            "reading the whole output")


def _from_every_batch(book, r, storage, spool, name: JobName, reason: str, continue_output: bool,
                      cap: int, tally: Tally) -> None:
    """The rows found by reading the job's whole output, newest row per id first."""
    from dataclasses import replace

    from dflash_tasks.ledger import EndedRow
    from dflash_tasks.output.batches import iter_newest_placed
    from dflash_tasks.sglang.ongoing import entry_from_row

    for place, row in iter_newest_placed(r, storage, name, spool=spool):
        meta = row["metadata"]
        if meta["finish_reason"] != reason:
            continue
        if continue_output and reason == "length" and meta["completion_tokens"] >= cap:
            _refuse_capped(name, row["id"], meta["completion_tokens"], cap)
        tally.reopen(book, name, replace(EndedRow.from_row(row), entry=place),
                     entry_from_row(row, continue_output=continue_output, cap=cap))
        if tally.full():
            break
