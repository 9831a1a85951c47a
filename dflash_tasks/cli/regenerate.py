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
import time
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
    skipped_at_cap: int = 0  # continuations left out: their rows are at the cap already
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


def _sample_size(ctx, param, value: str | None) -> tuple[int, float] | None:
    """--sample: (a count, 0.0) or (0, a share), from "300" or "2%"."""
    if value is None:
        return None
    try:
        if value.endswith("%"):
            share = float(value[:-1]) / 100
            if 0 < share <= 1:
                return 0, share
        elif int(value) > 0:
            return int(value), 0.0
    except ValueError:
        pass
    raise click.BadParameter(f"{value!r}: a count of rows (300) or a share of them (2%)")


@click.command()
@job_option
@click.option("--finish-reason", required=True,
              help="Rows that ended this way: length (cut by max_tokens), stop, or another reason "
                   "the job's rows have (status lists them).")
@click.option("--continue", "continue_output", is_flag=True,
              help="Continue truncated outputs from their token ids (SGLang /generate) instead of "
                   "starting over: only the missing tokens are generated.")
@click.option("--limit", type=click.IntRange(min=1), help="At most N prompts.")
@click.option("--skip-looping", is_flag=True,
              help="Leave out rows whose output ends in a repetition loop (more tokens buy more "
                   "of the loop).")
@click.option("--sample", "sample", metavar="N|P%", callback=_sample_size,
              help="With --continue: continue a random sample of the truncated rows first (a "
                   "count, or a share: 2%), wait for it, and report what the rest would cost "
                   "at the job's cap: how many finish, how many loop, the extra tokens, the "
                   "GPU-hours and the wall time. The sample's rows are kept.")
@click.option("--seed", type=int, help="The sample's random seed (a sample drawn again).")
@click.option("--json", "as_json", is_flag=True, help="The sample's report as JSON.")
def regenerate(name: JobName, finish_reason: str, continue_output: bool, limit: int | None,
               skip_looping: bool, sample: tuple[int, float] | None, seed: int | None,
               as_json: bool) -> None:
    """Generate again the prompts whose row ended with FINISH_REASON. The new row replaces the
    old one (readers keep the newest row per id); counters and progress.json follow. A
    truncated row continued (--continue) goes on to the job's cap (`manage.py set --job NAME
    --max-output-tokens N` raises it first); one already at the cap is left as it is."""
    from dflash_tasks import dispatch
    from dflash_tasks.core import jobs
    from dflash_tasks.ledger import shared_ledger
    from dflash_tasks.output.batches import BadManifest, RowNotFound
    from dflash_tasks.output.spool import Spool
    from dflash_tasks.output.storage import StorageError, job_output
    from dflash_tasks.tasks.app import app

    if sample and not (continue_output and finish_reason == "length"):
        raise click.UsageError("--sample measures a continuation: with --continue and "
                               "--finish-reason length")
    if sample and limit:
        raise click.UsageError("--sample and --limit are exclusive")
    r = redis_or_fail()
    job = job_or_fail(r, name)
    allowed_or_fail("regenerate", job)
    if sample and job.status != "done":
        raise click.ClickException(
            f"job {name} is {job.status}: a sample's figures are read from the job's counters, "
            f"which only the sample may move; run it once the job is done (`manage.py status "
            f"--job {name} --watch` waits for it)")
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
    before = book.counters(name)
    drawn: Draw | None = None
    try:
        if sample and indexed != counted:
            raise click.ClickException(_why_every_batch(name, finish_reason, indexed, counted)
                                       + ": --sample needs the index; continue them all")
        if indexed != counted:
            console.print(_why_every_batch(name, finish_reason, indexed, counted))
            _from_every_batch(book, r, storage, spool, name, finish_reason, continue_output, cap,
                              tally, skip_looping)
        elif continue_output and finish_reason == "length":
            drawn = _continue_from_index(book, r, storage, spool, name, cap, tally,
                                         skip_looping=skip_looping, sample=sample, seed=seed)
        else:  # only a truncated row is continued: the others start over, from the index alone
            for ended in book.ended_rows(name, finish_reason):
                if skip_looping and ended.looping:
                    continue
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
    if drawn is not None:
        _report_sample(r, book, name, cap, before, drawn, tally, skip_looping, as_json)
        return
    console.print(f"job {name}: {tally.reopened:,} prompts with finish_reason {finish_reason!r} "
                  f"queued again at max_tokens {cap:,}")
    if tally.skipped_at_cap:
        console.print(f"  {tally.skipped_at_cap:,} already at the cap of {cap:,} are left as "
                      "they are")
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


@dataclass
class Draw:
    """The rows a --sample continues, drawn from the truncated rows it could."""
    candidates: int      # truncated rows below the cap (and not looping, with --skip-looping)
    rows: list           # the EndedRows drawn


def _continue_from_index(book, r, storage, spool, name: JobName, cap: int, tally: Tally, *,
                         skip_looping: bool = False, sample: tuple[int, float] | None = None,
                         seed: int | None = None) -> Draw | None:
    """Truncated rows continued from their token ids: the index finds them and says where each
    is; only the batches holding them are read, each once, oldest first. A row already at the
    cap is left as it is (a sample's, continued before); none below it is refused, with the
    cap to raise. With `sample`, a random draw of them; returned with what it was drawn from."""
    import random

    from dflash_tasks.output.batches import rows_at
    from dflash_tasks.sglang.ongoing import entry_from_row

    truncated = {ended.id: ended for ended in book.ended_rows(name, "length", prompts=False)
                 if not (skip_looping and ended.looping)}
    below = {i: ended for i, ended in truncated.items() if ended.completion_tokens < cap}
    if truncated and not below:  # refused before anything is taken back
        ended = max(truncated.values(), key=lambda e: e.completion_tokens)
        _refuse_capped(name, ended.id, ended.completion_tokens, cap)
    tally.skipped_at_cap = len(truncated) - len(below)
    drawn = None
    if sample is not None:
        count, share = sample
        size = min(len(below), count or max(1, round(share * len(below))))
        picked = random.Random(seed).sample(sorted(below), size)
        drawn = Draw(len(below), [below[i] for i in picked])
        below = {i: below[i] for i in picked}
    places = [(ended.entry, ended.id) for ended in below.values()]
    for prompt_id, row in rows_at(r, storage, name, places, spool=spool):
        tally.reopen(book, name, below[prompt_id],
                    entry_from_row(row, continue_output=True, cap=cap))
        if tally.full():
            break
    return drawn


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
                      cap: int, tally: Tally, skip_looping: bool = False) -> None:
    """The rows found by reading the job's whole output, newest row per id first."""
    from dataclasses import replace

    from dflash_tasks.ledger import EndedRow
    from dflash_tasks.output.batches import iter_newest_placed
    from dflash_tasks.sglang.ongoing import entry_from_row

    for place, row in iter_newest_placed(r, storage, name, spool=spool):
        meta = row["metadata"]
        if meta["finish_reason"] != reason or (skip_looping and meta.get("loop")):
            continue
        if continue_output and reason == "length" and meta["completion_tokens"] >= cap:
            _refuse_capped(name, row["id"], meta["completion_tokens"], cap)
        tally.reopen(book, name, replace(EndedRow.from_row(row), entry=place),
                     entry_from_row(row, continue_output=continue_output, cap=cap))
        if tally.full():
            break


def _report_sample(r, book, name: JobName, cap: int, before: dict, drawn: Draw, tally: Tally,
                   skip_looping: bool, as_json: bool) -> None:
    """Wait for the sample's rows, then say what they cost and what the rest would: from the
    job's counters, which only the sample moved (the job was done): each row taken back took
    its share out (reopen.lua) and its new row put its own in (complete.lua)."""
    from dflash_tasks.cli.common import err_console
    from dflash_tasks.core import jobs
    from dflash_tasks.ledger import HIST_BUCKET_TOKENS
    from dflash_tasks.ledger.histogram import length_percentile

    n = tally.reopened
    if not n:
        raise click.ClickException("no row of the sample could be taken back (each was taken "
                                   "back or finished meanwhile): nothing to measure")
    try:
        with err_console.status(f"job {name}: continuing a sample of {n:,} truncated rows to "
                                f"{cap:,} tokens ..."):
            while (job := jobs.load(r, name)) is not None and job.status != "done":
                time.sleep(1.0)
    except KeyboardInterrupt:
        err_console.print(f"stopped waiting: the sample's {n:,} rows go on and are kept, but "
                          "this report is not made (the job's counters are its figures only "
                          "until something else runs)")
        raise SystemExit(130) from None
    if job is None:
        raise click.ClickException(f"job {name} was deleted while its sample ran")
    after = book.counters(name)

    def delta(key: str) -> int:
        return int(after.get(key, 0)) - int(before.get(key, 0))

    finished = delta("finish:stop")
    looping = delta("looping:length") + sum(e.looping for e in drawn.rows)
    extra = delta("output_tokens")
    old_mean = sum(e.completion_tokens for e in drawn.rows) / len(drawn.rows)
    # The sample's new lengths: the histogram's change, and its old rows taken out of it.
    new_hist: dict[int, int] = {}
    for key in set(after) | set(before):
        if key.startswith("hist:"):
            new_hist[int(key[5:])] = delta(key)
    for e in drawn.rows:
        bucket = e.completion_tokens // HIST_BUCKET_TOKENS * HIST_BUCKET_TOKENS
        new_hist[bucket] = new_hist.get(bucket, 0) + 1
    extra_pct = {f"p{q}": max(0, (length_percentile(new_hist, q / 100, cap) or 0) - round(old_mean))
                 for q in (50, 90, 99)}
    rest = drawn.candidates - len(drawn.rows)
    rest_tokens = rest * extra / n
    span = float(after.get("last_completed_at", 0)) - float(after.get("first_completed_at", 0))
    rate = int(after.get("output_tokens", 0)) / span if span > 0 else 0.0
    gpus = len({k.split(":")[1] for k in after if k.startswith("gpu:") and k.endswith(":completed")
                and int(after[k]) > 0}) or 1
    report = {
        "job": name, "cap": cap, "sample": n, "candidates": drawn.candidates, "rest": rest,
        "finished_share": round(finished / n, 4), "looping_share": round(looping / n, 4),
        "still_cut_share": round((n - finished) / n, 4),
        "extra_tokens_per_row": {"mean": round(extra / n, 1), **extra_pct},
        "rest_extra_tokens": round(rest_tokens),
        "fleet_output_tokens_per_s": round(rate, 1), "gpus": gpus,
        "rest_gpu_hours": round(rest_tokens / (rate / gpus) / 3600, 3) if rate else None,
        "rest_wall_hours": round(rest_tokens / rate / 3600, 3) if rate else None,
    }
    rest_command = (f"manage.py regenerate --job {name} --finish-reason length --continue"
                    + (" --skip-looping" if skip_looping else ""))
    if as_json:
        click.echo(json.dumps({**report, "rest_command": rest_command}, indent=1))
        return
    console.print(
        f"job {name}: a sample of {n:,} of the {drawn.candidates:,} truncated rows continued to "
        f"{cap:,} tokens (kept):\n"
        f"  {finished / n:.1%} finished under the cap, {(n - finished) / n:.1%} cut again, "
        f"{looping / n:.1%} looping\n"
        f"  extra tokens per row: mean {extra / n:,.0f}, p50 {extra_pct['p50']:,}, "
        f"p90 {extra_pct['p90']:,}, p99 {extra_pct['p99']:,}\n"
        f"  the other {rest:,}: about {rest_tokens:,.0f} more tokens"
        + (f", {report['rest_gpu_hours']:,.2f} GPU-hours, {report['rest_wall_hours']:,.2f} h on "
           f"the job's {gpus} GPUs at its measured {rate:,.0f} tokens/s" if rate else "")
        + f"\n  continue them: `{rest_command}`", highlight=False)
