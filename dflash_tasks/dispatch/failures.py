"""The failed registry of a job: what is in it, grouped by reason, and putting prompts back.

A prompt enters the registry (ledger/lua/fail.lua) on a permanent error at once, or when its
transient retries are exhausted. Each entry records: id, reason (the error's class name: e.g.
invalid_request, timeout), class (permanent or transient), the last error text (the server's
message), HTTP status, attempts (requests sent in the round that failed), GPU and time; the
`failures` hash keeps how many times the prompt has entered the registry.

`retry_failed` leaves the prompt's own permanent failures (a prompt too long for the context, a
malformed conversation) in the registry unless asked for them (`include_permanent`, or a
`reason` that names them): sent again unchanged they fail the same way. It moves the selected
entries back to the front of the job's pending list in one atomic
step per chunk (ledger/lua/requeue_failed.lua), then tops every GPU's window up so they are sent at
once. An entry moves only if it is still exactly the record read, so the operation is idempotent
and safe against a crash or a second run at the same time. The `failed` counter drops as prompts
move out; `completed` rises as they succeed; one that fails again re-enters the registry, once,
with its new error (no loop: nothing retries a registry entry by itself).
"""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import redis
from celery import Celery

from dflash_tasks import dispatch
from dflash_tasks.core import jobs
from dflash_tasks.core.keys import BREAKERS, GpuName, JobName
from dflash_tasks.core.settings import Settings
from dflash_tasks.ledger import Ledger
from dflash_tasks.sglang import PERMANENT_REASONS, TRANSIENT_REASONS

CHUNK = 500
CLASSES = ("transient", "permanent")


def record_class(record: dict) -> str:
    if record.get("class") in CLASSES:
        return record["class"]
    return "transient" if record.get("transient") or record.get("reason") in TRANSIENT_REASONS \
        else "permanent"


def matches(record: dict, reason: str | None, gpu: GpuName | None) -> bool:
    if gpu is not None and str(record.get("gpu")) != gpu:
        return False
    if reason is None:
        return True
    return reason in (record.get("reason"), record_class(record))


def read(book: Ledger, job: JobName) -> list[tuple[str, str, dict]]:
    """Every registry entry as (id, raw JSON, parsed record with `failures` added)."""
    entries = []
    for prompt_id, raw in book.failed_records(job):
        try:
            record = json.loads(raw)
        except ValueError:
            record = {"reason": "unknown", "error": raw[:2000]}
        record.setdefault("id", prompt_id)
        entries.append((prompt_id, raw, record))
    if entries:
        times = book.r.hmget(job.failures, [e[0] for e in entries])
        for (_, _, record), n in zip(entries, times):
            record["failures"] = int(n) if n else 1
    return entries


def summary(book: Ledger, job: JobName) -> dict:
    """The registry grouped by reason, plus the retry counters and the breakers' states."""
    entries = read(book, job)
    groups: dict[str, list[dict]] = defaultdict(list)
    for _, _, record in entries:
        groups[record.get("reason", "unknown")].append(record)
    reasons = {}
    for reason, records in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        records.sort(key=lambda rec: rec.get("at") or 0)
        errors = Counter(rec.get("error", "") for rec in records)
        reasons[reason] = {
            "class": record_class(records[0]),
            "count": len(records),
            "gpus": dict(sorted(Counter(str(rec.get("gpu")) for rec in records).items())),
            "errors": [{"error": e, "count": n} for e, n in errors.most_common(5)],
            "prompts": records,
        }
    counters = book.counters(job)
    retries = {k.split(":", 1)[1]: v for k, v in counters.items() if k.startswith("retry:")}
    return {
        "job": job,
        "failed": len(entries),
        "failed_counter": counters.get("failed", 0),
        "by_class": dict(Counter(record_class(rec) for _, _, rec in entries)),
        "reasons": reasons,
        "retries": counters.get("retries", 0),
        "retries_by_reason": retries,
        "requeued": counters.get("requeued", 0),
        "breakers": breakers(book.r),
    }


def breakers(r: redis.Redis) -> dict:
    out = {}
    for gpu, raw in sorted(r.hgetall(BREAKERS).items()):
        try:
            out[gpu.decode()] = json.loads(raw)
        except ValueError:
            continue
    return out


@dataclass
class RetryReport:
    requeued: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    missing: int = 0            # left in the registry: the prompt's messages are gone
    skipped_changed: int = 0    # changed or gone between reading and moving (another run)
    dispatched: int = 0         # tasks published right away (the rest wait for a window slot)
    status: str = ""
    # the prompt's own permanent failures left in the registry, by reason (not asked for)
    skipped_permanent: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"requeued": self.requeued, "by_reason": self.by_reason, "missing": self.missing,
                "skipped_changed": self.skipped_changed, "dispatched": self.dispatched,
                "status": self.status, "skipped_permanent": self.skipped_permanent}


def retry_failed(app: Celery, book: Ledger, s: Settings, job: JobName, *, reason: str | None = None,
                 gpu: GpuName | None = None, dry_run: bool = False,
                 include_permanent: bool = False) -> RetryReport:
    r = book.r
    info = jobs.load(r, job)
    if info is None:
        raise KeyError(f"no job named {job!r}")
    report = RetryReport(status=info.status)
    permanent_too = include_permanent or reason is not None  # a reason asked for by name
    selected: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for prompt_id, raw, record in read(book, job):
        if not matches(record, reason, gpu):
            continue
        why = record.get("reason", "unknown")
        if record_class(record) == "permanent" and not permanent_too:
            report.skipped_permanent[why] = report.skipped_permanent.get(why, 0) + 1
            continue
        selected[why].append((prompt_id, raw))
    for why, items in sorted(selected.items()):
        if dry_run:
            report.by_reason[why] = len(items)
            report.requeued += len(items)
            continue
        moved_here = 0
        for start in range(0, len(items), CHUNK):
            chunk = items[start:start + CHUNK]
            moved, missing = book.requeue_failed(job, chunk)
            moved_here += moved
            report.missing += missing
            report.skipped_changed += len(chunk) - moved - missing
        if moved_here:
            report.by_reason[why] = moved_here
            report.requeued += moved_here
    if report.requeued and not dry_run:
        # A done job runs again in the step that moved its prompts (requeue_failed.lua).
        info = jobs.load(r, job)
        report.status = info.status if info else "deleted"
        if info is not None and report.status == "running":
            report.dispatched += dispatch.topup_all(app, book, s, info)
    return report


__all__ = ["summary", "retry_failed", "RetryReport", "read", "matches", "record_class",
           "CLASSES", "TRANSIENT_REASONS", "PERMANENT_REASONS"]
