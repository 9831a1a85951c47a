"""Sealing finished rows into compressed JSONL batches, crash-safe.

Rows wait in the job's Redis stream. A batch is sealed in four steps, and the first one records
which stream entries it covers, so a crash after any step is finished by the next tick with the
same entries and the same name (writing a batch twice is harmless, losing or splitting one is
impossible):

1. write the intent {name, first, last} to `sealing`;
2. write <job>/batches/<name>.jsonl.zst to storage;
3. enter it in the manifest (Redis, counted once per name), then rewrite manifest.json;
4. delete its entries from the stream and clear the intent.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass

import redis
import zstandard

from .keys import JobKeys
from .ledger import Ledger
from .settings import Settings
from .storage import Storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchPolicy:
    rows: int
    bytes: int
    max_age_s: float

    @classmethod
    def from_settings(cls, s: Settings) -> "BatchPolicy":
        return cls(rows=s.batch_rows, bytes=s.batch_bytes, max_age_s=s.batch_max_age_s)


def batch_key(job: str, name: str) -> str:
    return f"{job}/batches/{name}.jsonl.zst"


def manifest_key(job: str) -> str:
    return f"{job}/manifest.json"


def batch_name(first_entry_id: str) -> str:
    ms, seq = first_entry_id.split("-")
    return f"batch-{int(ms):013d}-{int(seq):04d}"


class BatchWriter:
    def __init__(self, r: redis.Redis, book: Ledger, storage: Storage, policy: BatchPolicy):
        self.r, self.book, self.storage, self.policy = r, book, storage, policy

    def flush(self, job: str, *, final: bool = False) -> list[str]:
        """Seal every full batch (every batch at all when final); returns the names written.
        Holds the job's flush lock, so two beats never write the same rows twice."""
        k = JobKeys(job)
        lock = self.r.lock(k.flush_lock, timeout=900, blocking=False)
        if not lock.acquire():
            return []
        try:
            written = []
            intent = self.r.get(k.sealing)
            if intent:  # a previous tick died mid-batch: finish exactly that batch
                written.append(self._seal(job, json.loads(intent)))
            while (intent := self._next_intent(job, final)) is not None:
                self.r.set(k.sealing, json.dumps(intent))
                written.append(self._seal(job, intent))
            return written
        finally:
            try:
                lock.release()
            except redis.exceptions.LockError:
                log.warning("job %s: flush lock expired before release", job)

    def _next_intent(self, job: str, final: bool) -> dict | None:
        entries = self.r.xrange(JobKeys(job).output, count=self.policy.rows)
        if not entries:
            return None
        size, last = 0, None
        for entry_id, fields in entries:
            size += len(fields[b"row"]) + 1
            last = entry_id
            if size >= self.policy.bytes:
                break
        full = len(entries) >= self.policy.rows or size >= self.policy.bytes
        first = entries[0][0].decode()
        if not (full or final or self._age_s(first) >= self.policy.max_age_s):
            return None
        return {"name": batch_name(first), "first": first, "last": last.decode()}

    def _age_s(self, entry_id: str) -> float:
        seconds, micros = self.r.time()
        return seconds + micros / 1e6 - int(entry_id.split("-")[0]) / 1000

    def _seal(self, job: str, intent: dict) -> str:
        k = JobKeys(job)
        name = intent["name"]
        entries = self.r.xrange(k.output, min=intent["first"], max=intent["last"])
        # Entered in the manifest already: the crash came after step 3, the file is complete.
        if entries and not self.r.hexists(k.manifest, name):
            self._write(job, name, [fields[b"row"] for _, fields in entries])
        if entries:  # one XDEL: the batch's rows leave the stream all together
            self.r.xdel(k.output, *[entry_id for entry_id, _ in entries])
        self.r.delete(k.sealing)
        return name

    def _write(self, job: str, name: str, rows: list[bytes]) -> None:
        data = zstandard.ZstdCompressor(level=3, write_checksum=True).compress(b"\n".join(rows) + b"\n")
        key = batch_key(job, name)
        self.storage.put(key, data)
        first, last = (json.loads(row)["metadata"]["completed_at"] for row in (rows[0], rows[-1]))
        self.book.record_batch(job, name, {
            "name": name, "key": key, "rows": len(rows), "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "first_completed_at": first, "last_completed_at": last})
        self.write_manifest(job)
        log.info("job %s: sealed %s (%d rows, %d bytes) at %s", job, name, len(rows), len(data),
                 self.storage.location(key))

    def manifest(self, job: str) -> dict:
        records = sorted((json.loads(v) for v in self.r.hvals(JobKeys(job).manifest)),
                         key=lambda rec: rec["name"])
        return {"job": job, "batches": records, "rows": sum(rec["rows"] for rec in records),
                "bytes": sum(rec["bytes"] for rec in records)}

    def write_manifest(self, job: str) -> None:
        self.storage.put(manifest_key(job), json.dumps(self.manifest(job), indent=1).encode())


class ChecksumMismatch(ValueError):
    pass


def read_batch(storage: Storage, record: dict) -> list[dict]:
    """A sealed batch's rows, after checking its bytes against the manifest's sha256."""
    data = storage.get(record["key"])
    digest = hashlib.sha256(data).hexdigest()
    if digest != record["sha256"]:
        raise ChecksumMismatch(f"{storage.location(record['key'])}: sha256 {digest} does not "
                               f"match the manifest's {record['sha256']}")
    text = zstandard.ZstdDecompressor().decompress(data)
    return [json.loads(line) for line in text.splitlines() if line]


def read_manifest(storage: Storage, job: str) -> dict:
    return json.loads(storage.get(manifest_key(job)))
