"""A job's shipped rows, read through its manifest (a local directory or S3), the newest copy
of each id only.

Batches are named in time order (`batch-<ms>-<seq>`, from the first stream entry they hold) and
rows within a batch are in completion order, so reading batches from the newest back, and each
batch from its last row back, meets the newest copy of an id first: a regenerated row replaces
the older one with the same id, and every older copy is counted as a duplicate. Every batch is
verified against the manifest (sha256, zstd checksum, row count) as it is read.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from dflash_tasks.output.batches import (
    BadManifest,
    check_records,
    manifest_key,
    read_batch,
    read_manifest,
    superseded_key,
)
from dflash_tasks.output.storage import LocalStorage, Storage, StorageNotFound


class NoManifest(RuntimeError):
    pass


class InvalidManifest(NoManifest):
    """A manifest with an entry sealing could not have written (batches.check_records)."""


class ExportedJob(LocalStorage):
    """A directory written by `manage.py export --to DIR` (DIR/manifest.json, DIR/batches/...)
    read as if it were the job's storage (<job>/manifest.json, <job>/batches/...)."""

    def __init__(self, root: Path, job: str):
        super().__init__(root)
        self.job = job

    def _rel(self, key: str) -> str:
        prefix = f"{self.job}/"
        return key[len(prefix):] if key.startswith(prefix) else key

    def get(self, key: str) -> bytes:
        return super().get(self._rel(key))

    def exists(self, key: str) -> bool:
        return super().exists(self._rel(key))

    def location(self, key: str) -> str:
        return super().location(self._rel(key))


def job_storage(storage: Storage, job: str) -> Storage:
    """`storage` itself, or, for a local directory that holds an export of the job rather than
    the job's own layout, that export."""
    if isinstance(storage, LocalStorage) and not isinstance(storage, ExportedJob) \
            and not storage.exists(f"{job}/manifest.json") and storage.exists("manifest.json"):
        return ExportedJob(storage.root, job)
    return storage


def manifest_records(storage: Storage, job: str, parts: dict | None = None) -> list[dict]:
    """The manifest's batch records, oldest first (`storage` as job_storage() returns it;
    `parts`: the manifest's parts already read, read_manifest's)."""
    try:
        manifest = read_manifest(storage, job, parts)
    except StorageNotFound:
        raise NoManifest(f"no manifest for job {job!r} at {storage.location(job + '/manifest.json')}: "
                         "nothing shipped yet, or the wrong location (--from: the output "
                         "directory, an s3:// URI, or a directory written by manage.py export)") from None
    try:
        records = check_records(job, manifest.get("batches", []),
                                storage.location(manifest_key(job)))
    except BadManifest as exc:
        raise InvalidManifest(str(exc)) from None
    return sorted(records, key=lambda rec: rec["name"])


def superseded_rows(storage: Storage, job: str) -> dict[str, frozenset[str]]:
    """Batch name -> the ids of its rows that a regenerate replaced later (beat's
    <job>/superseded.json; none when there is no such file): what a reader that sees only
    some batches skips, to keep the newest row per id as every reader does."""
    try:
        listed = json.loads(storage.get(superseded_key(job)))["superseded"]
    except StorageNotFound:
        return {}
    return {name: frozenset(ids) for name, ids in listed.items()}


@dataclass
class NewestRows:
    """Iterate the newest copy of every id; `duplicates` counts the older copies skipped."""
    storage: Storage
    job: str
    records: list[dict] | None = None
    on_duplicate: Callable[[dict], None] | None = None
    on_batch: Callable[[dict], None] | None = None
    limit: int | None = None  # stop after this many rows (the newest ones)
    duplicates: int = 0
    batches: int = 0

    def __post_init__(self) -> None:
        self.storage = job_storage(self.storage, self.job)

    def __iter__(self) -> Iterator[dict]:
        records = self.records if self.records is not None else manifest_records(self.storage, self.job)
        seen: set[str] = set()
        yielded = 0
        for rec in reversed(records):
            rows = read_batch(self.storage, rec)
            self.batches += 1
            if self.on_batch:
                self.on_batch(rec)
            for row in reversed(rows):
                rid = str(row.get("id"))
                if rid in seen:
                    self.duplicates += 1
                    if self.on_duplicate:
                        self.on_duplicate(row)
                    continue
                seen.add(rid)
                yield row
                yielded += 1
                if self.limit is not None and yielded >= self.limit:
                    return
