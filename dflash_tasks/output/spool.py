"""Sealed batches that the storage could not take (S3 down), kept on beat's local disk until it can.

Without it, the rows of an S3 outage would wait in Redis, about 9 GB an hour at 64 GPUs, until
Redis died of memory and took the broker and the ledger with it. With it, a sealed batch leaves
Redis either way: to S3, or here. A spooled batch is the very file S3 would have received (zstd
with its frame checksum), under <root>/<job>/<name>.jsonl.zst; its SHA-256 is in the job's
manifest, checked again before it goes up. batches.py decides when to spool and when to ship.

A file is written to a temporary name, fsync'd, renamed into place, and its directory fsync'd:
once write() returns, the batch survives a crash of beat or of the machine, so its rows may
leave Redis. A disk that is full (ENOSPC) or unwritable raises OSError, the file is not left
half-written, and the rows stay in Redis.
"""
from __future__ import annotations

import os
from pathlib import Path

from dflash_tasks.output.sealing import BATCH_NAME
from dflash_tasks.output.storage import fsync_dir, write_whole

SUFFIX = ".jsonl.zst"


class Spool:
    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, job: str, name: str) -> Path:
        if not BATCH_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a batch name")
        return self.root / job / f"{name}{SUFFIX}"

    def write(self, job: str, name: str, data: bytes) -> Path:
        """The batch, durably on disk when this returns (file and directory fsync'd)."""
        path = self.path(job, name)
        if not path.parent.is_dir():  # a new job directory: its own entry made durable too
            path.parent.mkdir(parents=True, exist_ok=True)
            fsync_dir(path.parent.parent)
        write_whole(path, data, sync_dir=True)
        return path

    def read(self, job: str, name: str) -> bytes:
        return self.path(job, name).read_bytes()

    def names(self, job: str) -> list[str]:
        """The job's spooled batches, oldest first (a name is its first row's stream id)."""
        try:
            entries = os.listdir(self.root / job)
        except (FileNotFoundError, NotADirectoryError):  # nothing was ever spooled there
            return []
        return sorted(e[:-len(SUFFIX)] for e in entries
                      if e.endswith(SUFFIX) and BATCH_NAME.fullmatch(e[:-len(SUFFIX)]))

    def remove_job(self, job: str) -> int:
        """Remove every batch the job has here (its job is deleted); returns how many went."""
        names = self.names(job)
        for name in names:
            self.discard(job, name)
        try:
            (self.root / job).rmdir()
        except OSError:  # not there, or something else in it: left as it is
            pass
        return len(names)

    def discard(self, job: str, name: str) -> None:
        """Remove a batch that is in the storage now (a missing one is fine: already gone)."""
        self.path(job, name).unlink(missing_ok=True)

