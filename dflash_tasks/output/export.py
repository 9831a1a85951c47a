"""Download a job's whole dataset from its storage (S3 or a directory) and prove it complete:
every batch matches the manifest's sha256, its zstd checksum and its row count, no id appears
twice, and the rows add up to the job's completed count. Batches already in the destination
with the right sha256 are not downloaded again, so an interrupted export resumes."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dflash_tasks.core import jobs
from dflash_tasks.core.keys import JobName
from dflash_tasks.output.batches import (
    BadManifest,
    check_records,
    manifest_key,
    read_manifest,
    verify_batch,
)
from dflash_tasks.output.progress import progress_key, read_progress
from dflash_tasks.output.storage import LocalStorage, Storage, StorageNotFound

_ID = re.compile(rb'^\{"id":("(?:[^"\\]|\\.)*")')


class ExportError(RuntimeError):
    pass


@dataclass
class ExportReport:
    job: JobName
    dest: Path
    batches: int = 0
    rows: int = 0
    bytes: int = 0
    downloaded: int = 0
    reused: int = 0
    expected: int | None = None
    expected_source: str | None = None
    replaced: int = 0  # older rows of regenerated ids, superseded by a newer row
    problems: list[str] = field(default_factory=list)


def row_id(line: bytes) -> str:
    """A row's id, read from the start of its JSON line (rows are written with "id" first),
    falling back to a full parse."""
    m = _ID.match(line)
    return json.loads(m.group(1)) if m else json.loads(line)["id"]


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def export(storage: Storage, job: str, dest: Path, *, expected: int | None = None,
           expected_source: str | None = None, allow_partial: bool = False,
           regenerated: int = 0,
           on_batch: Callable[[dict], None] | None = None) -> ExportReport:
    """Copy <job>/manifest.json and every batch it lists into dest (dest/manifest.json,
    dest/batches/<name>.jsonl.zst), verifying each; raises ExportError on any mismatch.

    An id may have two rows only when it was regenerated (`manage.py regenerate`): the newer
    row, in the later batch, replaces the older. So ids in several rows may number at most
    `regenerated`, and it is the distinct ids that must equal the job's completed count."""
    report = ExportReport(job=job, dest=dest, expected=expected, expected_source=expected_source)
    where = storage.location(manifest_key(job))
    try:
        manifest = read_manifest(storage, job)  # its parts assembled: the export holds one piece
        # Every entry checked before the first write: a bad one leaves nothing behind.
        records = check_records(job, manifest.get("batches", []), where)
    except StorageNotFound:
        raise ExportError(f"no manifest at {where}: nothing was shipped for this job yet, or the "
                          "location is wrong") from None
    except (ValueError, AttributeError, KeyError, TypeError) as exc:
        raise ExportError(str(exc) if isinstance(exc, BadManifest)
                          else f"{where}: not a manifest ({exc})") from None
    names = [rec["name"] for rec in records]
    if len(set(names)) != len(names):
        raise ExportError("the manifest lists a batch twice")
    if sum(rec["rows"] for rec in records) != manifest.get("rows"):
        raise ExportError("the manifest's total rows differ from the sum of its batches")

    local = LocalStorage(dest)
    seen: set[str] = set()
    doubled: list[str] = []
    for rec in records:
        rel = f"batches/{rec['name']}.jsonl.zst"
        path = dest / rel
        reuse = path.exists() and _sha256_file(path) == rec["sha256"]
        data = path.read_bytes() if reuse else storage.get(rec["key"])
        lines = verify_batch(data, rec, storage.location(rec["key"]))  # raises ChecksumMismatch
        if reuse:
            report.reused += 1
        else:
            local.put(rel, data)  # temporary file and rename: never half a batch in dest
            report.downloaded += 1
        for line in lines:
            rid = row_id(line)
            if rid in seen:
                doubled.append(rid)
            seen.add(rid)
        report.batches += 1
        report.rows += len(lines)
        report.bytes += len(data)
        if on_batch:
            on_batch(rec)
    if len(doubled) > regenerated:
        raise ExportError(f"{len(doubled)} ids appear in more than one row, e.g. {doubled[:5]}"
                          + (f", but only {regenerated} were regenerated" if regenerated else ""))
    report.replaced = len(doubled)
    report.rows = len(seen)
    local.put("manifest.json", json.dumps(manifest, indent=1).encode())
    try:
        local.put("progress.json", storage.get(progress_key(job)))
    except StorageNotFound:
        pass
    if expected is not None and report.rows != expected:
        message = (f"{report.rows:,} rows exported, but the job has {expected:,} completed "
                   f"({expected_source})")
        if not allow_partial:
            raise ExportError(message + ("; rows not yet shipped are still in Redis, export "
                                         "again when the job is done or pass --allow-partial"
                                         if report.rows < expected else ""))
        report.problems.append(message)
    return report


def expected_completed(storage: Storage, job: JobName,
                       r=None) -> tuple[int | None, str | None, str | None]:
    """(completed, where that figure comes from, job status): the ledger in Redis when it
    knows the job, else the progress.json beside the batches."""
    if r is not None:
        try:
            found = jobs.load(r, job)
        except Exception:
            found = None
        if found is not None:
            completed = int(r.hget(job.counters, "completed") or 0)
            return completed, "the ledger in Redis", found.status
    progress = read_progress(storage, job)
    if progress is None or not isinstance(progress.get("completed"), int):
        return None, None, None
    return progress["completed"], storage.location(progress_key(job)), progress.get("status")
