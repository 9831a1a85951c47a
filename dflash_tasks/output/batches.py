"""Sealing finished rows into compressed JSONL batches and shipping them, crash-safe.

Rows wait in the job's Redis stream. Whether a batch is ready is read from counters and ids,
never from the rows: XLEN, and the bytes waiting and the oldest row's time, which complete.lua
keeps beside the rows (`unsealed_bytes`, `unsealed_since_ms`) and drop_sealed.lua takes back, so
a tick costs the same at 100,000 waiting rows as at 1,000. Rows are read once, to seal them, a
page at a time.

A batch is sealed in five steps. The first one records which stream entries the batch covers,
so a crash after any step is finished by the next tick with the same entries and the same name:
no row is lost, none lands in two batches, and uploading a batch twice only overwrites it with
the same bytes.

1. intent: write {name, first, last} to `sealing`;
2. upload: put <job>/batches/<name>.jsonl.zst to storage (S3 or the output directory);
3. record: enter it in the Redis manifest and count it (record_batch.lua, once per name);
4. manifest: rewrite <job>/manifest.json in storage from the Redis manifest;
5. delete: remove its entries from the stream (drop_sealed.lua), then clear the intent.

Recovery reads the intent: before step 3 the batch is uploaded again; from step 3 on it is
recorded, so the upload is skipped and steps 4 and 5 are redone (both idempotent).

While storage fails (S3 unreachable), step 2 writes the batch to the spool instead (spool.py:
beat's local disk, fsync'd; the manifest records it with `location: local-spool` and its path),
so steps 3 to 5 take its rows out of Redis all the same: Redis holds the rows waiting to be
sealed, never the outage's. Every later batch goes to the spool too until the spool is empty
again, so batches reach the storage in the order they were sealed. Each flush first ships the
spooled batches, oldest first: upload (the same key and bytes, its sha256 checked first),
switch its manifest record to the storage's location (ship_spooled.lua, once), rewrite
manifest.json, delete the file. A crash between two of these steps is finished by the next
flush: a file whose record already says "in storage" only needs the manifest and the delete.
manifest.json lists only the batches in storage, so its readers find every batch it lists.
When the spool cannot be written either (a full disk), step 2 raises: the intent stays, the
rows stay in Redis, and the tick holds dispatch (control.py) until a batch can leave again.
Without a spool (batches in a local directory) a failed write raises the same way.

tests/crashing_beat.py runs a real beat that exits, as abruptly as SIGKILL, right after a
chosen step, from outside this module.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from bisect import bisect_right
from dataclasses import dataclass
from typing import Callable, Iterator

import redis
import zstandard

from dflash_tasks.core.keys import JobName
from dflash_tasks.core.locks import HeldLock
from dflash_tasks.core.settings import Settings
from dflash_tasks.ledger import Ledger, entry_order
from dflash_tasks.output import sealing
from dflash_tasks.output.sealing import BATCH_NAME, batch_name
from dflash_tasks.output.spool import Spool
from dflash_tasks.output.storage import Storage, StorageError

log = logging.getLogger(__name__)

LATENCY_BUCKETS_PER_DECADE = 20  # e2e latency histogram in counters: "lat:<b>", b = 20*log10(ms)
SPOOLED = "local-spool"  # a manifest record's location while its batch waits in the spool
# Rows per XRANGE while taking a batch: a batch cut by size reads at most this many ahead.
PAGE_ROWS = 100

# Told of every batch once it is recorded: the job and its (stream id, row) pairs, oldest first
# (the quality monitor samples them: the rows are parsed once, here).
OnSealed = Callable[[str, list[tuple[str, dict]]], object]


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


# Batches per part of a manifest (write_manifest): manifest.json is rewritten after every batch,
# so what it holds inline is what each rewrite costs; 8 keeps the bytes written over a run within
# about 6 times the manifest's final size (benchmarks, case 12), with a part object every 8
# batches for a reader to fetch once.
MANIFEST_PART_BATCHES = 8


def manifest_part_key(job: str, part: int) -> str:
    return f"{job}/manifest/part-{part:06d}.json"


def superseded_key(job: str) -> str:
    return f"{job}/superseded.json"


class BadManifest(ValueError):
    """A manifest entry that sealing could not have written; the message names it."""


def check_records(job: str, records, where: str) -> list[dict]:
    """The manifest's batch records, each checked to be one sealing writes: a name batch_name
    produces and the key batch_key gives it. A manifest is data (from a bucket or a Redis that
    others write to): a name like `../../x` would otherwise become a path outside where a
    reader writes or reads. Raises BadManifest naming the first bad entry."""
    if not isinstance(records, list):
        raise BadManifest(f"{where}: 'batches' is not a list")
    for i, rec in enumerate(records):
        name = rec.get("name") if isinstance(rec, dict) else None
        if not isinstance(name, str) or not BATCH_NAME.fullmatch(name):
            raise BadManifest(f"{where}: batch entry {i} has the name {name!r}, which sealing "
                              "never writes (batch-<13 digits>-<4 digits>): refused")
        if rec.get("key") != batch_key(job, name):
            raise BadManifest(f"{where}: batch entry {i} ({name}) has the key "
                              f"{rec.get('key')!r}, not {batch_key(job, name)!r}: refused")
    return records


def latency_bucket(latency_s: float) -> int:
    ms = max(1.0, latency_s * 1000)
    return int(math.floor(LATENCY_BUCKETS_PER_DECADE * math.log10(ms)))


def latency_bucket_ms(bucket: int) -> float:
    """The geometric middle of a latency bucket, in milliseconds."""
    return 10 ** ((bucket + 0.5) / LATENCY_BUCKETS_PER_DECADE)


class BatchWriter:
    def __init__(self, r: redis.Redis, book: Ledger, storage: Storage, policy: BatchPolicy, *,
                 lock_ttl_s: float = 60.0, spool: Spool | None = None,
                 on_sealed: OnSealed | None = None):
        self.r, self.book, self.storage, self.policy = r, book, storage, policy
        self.lock_ttl_s, self.spool, self.on_sealed = lock_ttl_s, spool, on_sealed
        # The storage's failure during the last flush that the spool absorbed (its batches went
        # to the spool instead), for the tick to show; None when the storage took everything.
        self.storage_failure: StorageError | None = None

    def flush(self, job: JobName, *, final: bool = False) -> list[str]:
        """Seal every full batch (every batch at all when final); returns the names written
        (to the storage or the spool: their rows left Redis). Holds the job's flush lock, so two
        beats never seal at the same time. Raises StorageError (OSError from a local directory)
        when a batch can go nowhere; what was not sealed waits for the next call."""
        lock = HeldLock(self.r, job.flush_lock, self.lock_ttl_s)
        if not lock.acquire():
            return []
        with lock:
            self.storage_failure = None
            self._ship_spooled(job, lock)  # first: batches reach the storage in sealing order
            written = []
            intent = self.r.get(job.sealing)
            if intent:  # a previous tick died or failed mid-batch: finish exactly that batch
                written.append(self._seal(job, json.loads(intent), intent.decode(), lock))
            waiting = self._rows(job)
            while self._ready(job, final) and (entries := self._take(waiting)):
                lock.still_held()
                first, last = entries[0][0].decode(), entries[-1][0].decode()
                intent = {"name": batch_name(first), "first": first, "last": last}
                raw = json.dumps(intent)
                if not self.r.set(job.sealing, raw, nx=True):
                    log.warning("job %s: another writer's intent appeared; stopping", job)
                    break
                written.append(self._seal(job, intent, raw, lock, entries))
            return written

    def _ready(self, job: JobName, final: bool) -> bool:
        """Whether a batch is to be sealed now: rows wait and they fill a batch (by count or by
        bytes), or the oldest is max_age_s old, or this is the final flush. Counters and ids
        only, in one transaction."""
        pipe = self.r.pipeline(transaction=True)
        pipe.xlen(job.output)
        pipe.hmget(job.counters, "unsealed_bytes", "unsealed_since_ms")
        pipe.time()
        rows, (size, since_ms), (seconds, micros) = pipe.execute()
        if not rows:
            return False
        if final or rows >= self.policy.rows or int(size or 0) >= self.policy.bytes:
            return True
        # No time kept: rows stored before complete.lua kept it; seal them (then it is kept).
        return since_ms is None or \
            seconds + micros / 1e6 - int(since_ms) / 1000 >= self.policy.max_age_s

    def _rows(self, job: JobName) -> Iterator[tuple[bytes, dict]]:
        """The stream's entries, oldest first, read a page at a time as batches take them: what
        one batch leaves of its last page is the next batch's beginning, not read again."""
        key, after, page = job.output, "-", min(PAGE_ROWS, self.policy.rows)
        while entries := self.r.xrange(key, min=after, count=page):
            yield from entries
            after = "(" + entries[-1][0].decode()

    def _take(self, waiting: Iterator[tuple[bytes, dict]]) -> list[tuple[bytes, dict]]:
        """The next batch: entries up to `rows`, or until they reach `bytes` (that one included)."""
        entries, size = [], 0
        for entry in waiting:
            entries.append(entry)
            size += len(entry[1][b"row"]) + 1
            if len(entries) >= self.policy.rows or size >= self.policy.bytes:
                break
        return entries

    def _seal(self, job: JobName, intent: dict, raw_intent: str, lock: HeldLock,
              entries: list[tuple[bytes, dict]] | None = None) -> str:
        """Ship the intent's batch: its `entries` as just read, or (finishing an earlier tick's
        batch) the rows the intent names."""
        name = intent["name"]
        if entries is None:
            entries = self.r.xrange(job.output, min=intent["first"], max=intent["last"])
        raw = self.r.hget(job.manifest, name)
        record = json.loads(raw) if raw else None
        if entries and record is None:
            data, record, stats, rows = self._build(job, name, [f[b"row"] for _, f in entries])
            self.book.replicate_sealing(job, raw_intent)  # nothing ships that a failover may lose
            lock.still_held()
            record, stats = self._store(job, record, stats, data)
            lock.still_held()
            if sealing.record_batch(self.r, job, name, record, stats=stats) and self.on_sealed:
                self.on_sealed(job, [(entry_id.decode(), row)
                                     for (entry_id, _), row in zip(entries, rows)])
            if self.spool is not None and record["location"] != SPOOLED:
                self.spool.discard(job, name)  # spooled by a beat that died before recording it
            log.info("job %s: sealed %s (%d rows, %d bytes) at %s", job, name, record["rows"],
                     record["bytes"], record.get("spool", record["location"]))
        elif not entries and record is None:
            log.error("job %s: batch %s has no rows in the stream and no manifest entry; "
                      "dropping the intent", job, name)
        # Also after a crash between record and manifest: the mirror catches up. A spooled
        # batch is not in it yet (nor is the storage answering): the spool's shipping writes it.
        if record is not None and record["location"] != SPOOLED and self.storage_failure is None:
            lock.still_held()
            self._write_manifest_or_note(job)
        if entries:  # one call: the batch's rows leave the stream all together
            lock.still_held()
            sealing.drop_sealed(self.r, job, [entry_id for entry_id, _ in entries],
                                sum(len(fields[b"row"]) + 1 for _, fields in entries))
        sealing.clear_sealing(self.r, job, raw_intent)
        return name

    def _build(self, job: JobName, name: str,
               rows: list[bytes]) -> tuple[bytes, dict, dict, list[dict]]:
        """The batch file, its manifest record, the counters it adds (once, on record), and its
        rows parsed."""
        data = zstandard.ZstdCompressor(level=3, write_checksum=True).compress(b"\n".join(rows) + b"\n")
        key = batch_key(job, name)
        parsed = [json.loads(row) for row in rows]
        metas = [row["metadata"] for row in parsed]
        record = {
            "name": name, "key": key, "location": self.storage.location(key),
            "rows": len(rows), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "first_completed_at": min(m["completed_at"] for m in metas),
            "last_completed_at": max(m["completed_at"] for m in metas),
            "sealed_at": round(time.time(), 3)}
        stats: dict[str, int] = {}
        latency_ms = 0
        for m in metas:
            if m.get("latency_s") is not None:
                b = f"lat:{latency_bucket(float(m['latency_s']))}"
                stats[b] = stats.get(b, 0) + 1
                stats["latency_n"] = stats.get("latency_n", 0) + 1
                latency_ms += round(float(m["latency_s"]) * 1000)
        stats["latency_ms_sum"] = latency_ms
        if getattr(self.storage, "is_remote", False):
            stats["s3_uploaded"] = 1
            stats["s3_bytes"] = len(data)
        return data, record, stats, parsed

    def _store(self, job: JobName, record: dict, stats: dict[str, int],
               data: bytes) -> tuple[dict, dict[str, int]]:
        """Put the batch in the storage or, when the storage fails (or failed earlier in this
        flush, or spooled batches still wait: order), in the spool. Returns the manifest record
        and counters to enter. Raises StorageError when the spool cannot take it either (a
        full disk): the rows stay in Redis."""
        if self.spool is None or self.storage_failure is None:
            try:
                self.storage.put(record["key"], data)
                return record, stats
            except StorageError as exc:
                if self.spool is None:
                    raise
                self.storage_failure = exc
        try:
            path = self.spool.write(job, record["name"], data)
        except OSError as exc:  # a full disk (ENOSPC), an unwritable spool: the rows stay
            raise StorageError(f"{self.storage_failure}; and the spool could not take it "
                               f"either: {exc}") from exc
        # Counted as in S3 when it gets there (_ship_spooled), not before.
        stats = {k: v for k, v in stats.items() if k not in ("s3_uploaded", "s3_bytes")}
        stats.update(spooled=1, spooled_bytes=record["bytes"])
        return {**record, "location": SPOOLED, "spool": str(path)}, stats

    def _ship_spooled(self, job: JobName, lock: HeldLock) -> None:
        """Upload the job's spooled batches, oldest first, until the storage fails (then they
        and every batch sealed after them wait in the spool: the next flush goes on)."""
        if self.spool is None:
            return
        names = self.spool.names(job)
        if not names:
            if int(self.r.hget(job.counters, "spooled") or 0) > 0:  # rows nowhere beat can see
                self.storage_failure = StorageError(
                    f"job {job}: the manifest has batches in the spool, but {self.spool.root} "
                    f"holds none: is this beat on the machine (and disk) that spooled them?")
            return
        done: list[str] = []  # in the storage and recorded there: only the manifest and delete left
        for name in names:
            raw = self.r.hget(job.manifest, name)
            if raw is None:
                continue  # spooled by a beat that died before recording it: its intent finishes it
            record = json.loads(raw)
            if record["location"] == SPOOLED:
                lock.still_held()
                try:
                    data = self.spool.read(job, name)
                    verify_batch(data, record, record["spool"])
                    self.storage.put(record["key"], data)
                except (StorageError, OSError, ChecksumMismatch) as exc:
                    self.storage_failure = exc if isinstance(exc, StorageError) else \
                        StorageError(f"spooled batch {record['spool']}: {exc}")
                    break
                shipped = {key: v for key, v in record.items() if key != "spool"}
                shipped["location"] = self.storage.location(record["key"])
                counts = {"spooled": -1, "spooled_bytes": -record["bytes"]}
                if getattr(self.storage, "is_remote", False):
                    counts.update(s3_uploaded=1, s3_bytes=record["bytes"])
                lock.still_held()
                sealing.ship_spooled(self.r, job, name, raw.decode(), json.dumps(shipped), counts)
                log.info("job %s: shipped %s from the spool to %s", job, name, shipped["location"])
            done.append(name)
        # A file leaves the spool only once its manifest record says "in the storage" on the
        # replicas too (with DFLASH_REDIS_WAIT_REPLICAS): a failover must not lose the only
        # record of where the batch went. Unreplicated, the files stay for the next flush.
        if done:
            lock.still_held()
            if self._write_manifest_or_note(job) and \
                    self.book.replicated(job, f"job {job}'s shipped spool records"):
                for name in done:
                    self.spool.discard(job, name)

    def _write_manifest_or_note(self, job: JobName) -> bool:
        """manifest.json rewritten; with a spool, a storage failure is noted instead of raised
        (a later batch's rewrite, or the last one before the job is done, catches up)."""
        try:
            self.write_manifest(job)
            return True
        except StorageError as exc:
            if self.spool is None:
                raise
            self.storage_failure = exc
            return False

    def manifest(self, job: JobName) -> dict:
        """manifest.json: the batches in the storage (a spooled one is listed once it is there)."""
        records = sorted(stored_records(self.r, job), key=lambda rec: rec["name"])
        return {"job": job, "batches": records, "rows": sum(rec["rows"] for rec in records),
                "bytes": sum(rec["bytes"] for rec in records)}

    def write_manifest(self, job: JobName) -> None:
        """manifest.json, in parts, so that the bytes written for it over a run grow with the
        run, not with its square (a whole manifest rewritten after each of 10,000 batches was
        about 40 GB of PUTs): each run of MANIFEST_PART_BATCHES batches, in name order, becomes a
        part <job>/manifest/part-NNNNNN.json, written once when it is full; manifest.json holds
        the totals, how many parts there are and the batches of the part still filling.
        read_manifest assembles them. Batches reach the storage in name order (the spool keeps
        it), so a full part never changes."""
        m = self.manifest(job)
        records = m["batches"]
        full = len(records) // MANIFEST_PART_BATCHES
        written = int(self.r.get(job.manifest_parts) or 0)
        for part in range(min(written, full), full):
            first = part * MANIFEST_PART_BATCHES
            self.storage.put(manifest_part_key(job, part + 1), json.dumps(
                {"job": job, "part": part + 1,
                 "batches": records[first:first + MANIFEST_PART_BATCHES]}, indent=1).encode())
            self.r.set(job.manifest_parts, part + 1)
        self.storage.put(manifest_key(job), json.dumps(
            {**m, "part_size": MANIFEST_PART_BATCHES, "parts": full,
             "batches": records[full * MANIFEST_PART_BATCHES:]}, indent=1).encode())

    def write_superseded(self, job: JobName) -> bool:
        """<job>/superseded.json: per batch, the ids of its rows that a regenerate replaced
        since (reopen.lua records each old row's place), for readers that see only some batches
        and so cannot tell an old row from the newest (the torch dataset). Rewritten only when
        a row was superseded since the last write, once its batch is known (a row still in the
        stream waits for its batch); a regenerate is rare, so the writes are few. True when
        the object lists every superseded row."""
        pipe = self.r.pipeline(transaction=False)
        pipe.scard(job.superseded)
        pipe.get(job.superseded_written)
        count, written = pipe.execute()
        if count == int(written or 0):
            return True
        starts, records, waiting_from = _row_places(self.r, job)
        by_batch: dict[str, list[str]] = {}
        for member in self.r.smembers(job.superseded):
            place, _, prompt_id = member.decode().partition(" ")
            at = entry_order(place)
            first = bisect_right(starts, at) - 1
            if first >= 0 and (waiting_from is None or at < waiting_from):
                by_batch.setdefault(records[first]["name"], []).append(prompt_id)
        listed = sum(len(ids) for ids in by_batch.values())
        if listed != int(written or 0):
            self.storage.put(superseded_key(job), json.dumps(
                {"job": job, "rows": listed,
                 "superseded": {name: sorted(ids) for name, ids in sorted(by_batch.items())}},
                indent=1).encode())
            self.r.set(job.superseded_written, listed)
        return listed == count


def stored_records(r: redis.Redis, job: JobName) -> list[dict]:
    """The job's manifest records of the batches in the storage, not those waiting in the spool
    (a record without a location predates the spool: in the storage)."""
    return [rec for v in r.hvals(job.manifest)
            if (rec := json.loads(v)).get("location") != SPOOLED]


class ChecksumMismatch(ValueError):
    pass


def verify_batch(data: bytes, record: dict, where: str) -> list[bytes]:
    """A batch file's lines, after checking its sha256 against the manifest, its zstd frame
    checksum, and its row count."""
    digest = hashlib.sha256(data).hexdigest()
    if digest != record["sha256"]:
        raise ChecksumMismatch(f"{where}: sha256 {digest} does not match the manifest's "
                               f"{record['sha256']}")
    try:
        text = zstandard.ZstdDecompressor().decompress(data)
    except zstandard.ZstdError as exc:
        raise ChecksumMismatch(f"{where}: not a valid zstd file ({exc})") from None
    lines = [line for line in text.split(b"\n") if line]
    if len(lines) != record["rows"]:
        raise ChecksumMismatch(f"{where}: {len(lines)} rows, the manifest says {record['rows']}")
    return lines


def read_batch(storage: Storage, record: dict) -> list[dict]:
    """A sealed batch's rows, after checking its bytes against the manifest's sha256."""
    lines = verify_batch(storage.get(record["key"]), record, storage.location(record["key"]))
    return [json.loads(line) for line in lines]


def read_manifest(storage: Storage, job: str, parts: dict | None = None) -> dict:
    """The job's manifest, every batch record in it: manifest.json and the parts it counts
    (write_manifest). `parts`, kept by a reader that reads the manifest again and again (one
    following a running job), holds the parts read so far: a full part never changes."""
    head = json.loads(storage.get(manifest_key(job)))
    if not isinstance(head, dict) or not head.get("parts"):
        return head  # a manifest of one piece: an export, or one written before the parts
    records: list[dict] = []
    for part in range(1, int(head["parts"]) + 1):
        key = manifest_part_key(job, part)
        found = parts.get(key) if parts is not None else None
        if found is None:
            found = json.loads(storage.get(key))["batches"]
            if parts is not None:
                parts[key] = found
        records += found
    return {"job": head.get("job", job), "batches": records + head.get("batches", []),
            "rows": head.get("rows"), "bytes": head.get("bytes")}


class RowNotFound(LookupError):
    """A row is not where the ledger's index places it; the message names both."""


def read_batch_anywhere(r: redis.Redis, storage: Storage, job: JobName, record: dict, *,
                        spool: Spool | None = None) -> list[dict]:
    """A recorded batch's rows wherever it is now: the storage, or beat's spool while the
    storage has not taken it yet (an S3 outage). Raises StorageError when it is in neither."""
    if record.get("location") != SPOOLED:
        return read_batch(storage, record)
    name = record["name"]
    if spool is not None:
        try:
            lines = verify_batch(spool.read(job, name), record, str(spool.path(job, name)))
            return [json.loads(line) for line in lines]
        except FileNotFoundError:
            now = json.loads(r.hget(job.manifest, name) or "{}")
            if now.get("location", SPOOLED) != SPOOLED:  # shipped while this ran
                return read_batch(storage, now)
    raise StorageError(f"batch {name} waits in beat's spool ({record.get('spool')}) until the "
                       f"storage takes it, and this machine's spool "
                       f"({spool.root if spool else 'none'}) does not hold it: run this on "
                       "beat's machine, or once the storage has it")


def rows_at(r: redis.Redis, storage: Storage, job: JobName, places: list[tuple[str, str]], *,
            spool: Spool | None = None) -> Iterator[tuple[str, dict]]:
    """The rows at these (stream entry id, prompt id) places, as (prompt id, row), oldest first:
    each from the stream while it waits there, else from the batch that holds it, read once for
    every place in it (from the storage, or the spool). Batches are consecutive runs of the
    stream named by their first entry, so a place's batch is the last one starting at or before
    it: nothing else is read. Raises RowNotFound when a row is not where its place says."""
    todo = sorted(places, key=lambda place: entry_order(place[0]))
    starts, records, waiting_from = _row_places(r, job)
    i = 0
    while i < len(todo):
        entry, prompt_id = todo[i]
        at = entry_order(entry)
        if waiting_from is not None and at >= waiting_from:
            found = r.xrange(job.output, min=entry, max=entry)
            if found:
                yield prompt_id, json.loads(found[0][1][b"row"])
                i += 1
                continue
            starts, records, waiting_from = _row_places(r, job)  # sealed since: recorded now
            if waiting_from is not None and at >= waiting_from:
                raise RowNotFound(f"job {job}: the row of {prompt_id} is neither in the stream "
                                  f"(entry {entry}) nor in a batch")
        first = bisect_right(starts, at) - 1
        if first < 0:
            raise RowNotFound(f"job {job}: no batch holds stream entry {entry} ({prompt_id})")
        group = [todo[i]]
        i += 1
        while i < len(todo) and bisect_right(starts, entry_order(todo[i][0])) - 1 == first \
                and (waiting_from is None or entry_order(todo[i][0]) < waiting_from):
            group.append(todo[i])
            i += 1
        record = records[first]
        rows = read_batch_anywhere(r, storage, job, record, spool=spool)
        newest = {row["id"]: row for row in rows}  # an id's last line there is its newest row
        for entry, prompt_id in group:
            if prompt_id not in newest:
                raise RowNotFound(f"job {job}: batch {record['name']} holds no row of "
                                  f"{prompt_id}, which the ledger places there (entry {entry})")
            yield prompt_id, newest[prompt_id]


def _row_places(r: redis.Redis,
                job: JobName) -> tuple[list[tuple[int, int]], list[dict], tuple[int, int] | None]:
    """One look at where rows are: the recorded batches' first entries (sorted) and records,
    and the first entry still waiting in the stream (None: none waits)."""
    pipe = r.pipeline(transaction=True)
    pipe.hvals(job.manifest)
    pipe.xrange(job.output, count=1)
    raw, waiting = pipe.execute()
    records = check_records(job, [json.loads(v) for v in raw], f"job {job}'s manifest in Redis")
    records.sort(key=lambda rec: batch_first(rec["name"]))
    return ([batch_first(rec["name"]) for rec in records], records,
            entry_order(waiting[0][0].decode()) if waiting else None)


def batch_first(name: str) -> tuple[int, int]:
    """The stream entry a batch begins with, from its name (batch_name's inverse)."""
    _, ms, seq = name.split("-")
    return int(ms), int(seq)


def iter_newest_rows(r: redis.Redis, storage: Storage, job: JobName, *,
                     spool: Spool | None = None) -> Iterator[dict]:
    """Every id's newest row, newest first: the rows still in the stream, then the sealed
    batches from the last back (those in beat's spool from there, given the spool). A
    regenerated prompt has an older row in an earlier batch; it is skipped. Memory: the set of
    ids seen, not the rows."""
    for _, row in iter_newest_placed(r, storage, job, spool=spool):
        yield row


def iter_newest_placed(r: redis.Redis, storage: Storage, job: JobName, *,
                       spool: Spool | None = None) -> Iterator[tuple[str, dict]]:
    """iter_newest_rows with each row's place: its stream entry while it waits in the stream,
    else its batch's first entry (the ledger's index gives a row's place the same way)."""
    seen: set[str] = set()
    last = "+"
    while entries := r.xrevrange(job.output, max=last, count=1000):
        for entry_id, fields in entries:
            row = json.loads(fields[b"row"])
            if row["id"] not in seen:
                seen.add(row["id"])
                yield entry_id.decode(), row
        last = "(" + entries[-1][0].decode()
    records = sorted((json.loads(v) for v in r.hvals(job.manifest)), key=lambda rec: rec["name"],
                     reverse=True)
    for record in records:
        place = "%d-%d" % batch_first(record["name"])
        for row in reversed(read_batch_anywhere(r, storage, job, record, spool=spool)):
            if row["id"] not in seen:
                seen.add(row["id"])
                yield place, row
