"""Prompt bodies kept on the output storage instead of in Redis (`enqueue --bodies storage`).

At ten million prompts the bodies alone would take 7.5 GB of Redis (about 750 B each, compressed).
With this store the enqueue writes each chunk of prompts as one object of concatenated zstd frames,
`<job>/prompts/chunk-<n>.zst` under the job's body location, and the `prompts` hash holds a
reference of about 20 bytes per prompt instead of its frame:

    @<chunk>:<offset>:<length>

which no stored conversation starts with (a zstd frame starts with its magic number, JSON with
`[` or `{`). The worker reads exactly those bytes back (a file read at an offset, or an S3 ranged
GET) and decodes them as `messages.decode_messages` does any stored frame (`read_body`). The
storage itself (output/storage.py, a stage above) is given to these functions by their callers,
and its errors reach them as it raises them; what is this module's to say is whether the bytes
that came back are a prompt's entry (BodyCorrupt), and whether the ledger can say where they are
(BodyLost).

The location (an absolute directory or an s3:// URI) is the job's, fixed by its first such enqueue
(`jobs.body_location`): every chunk of a job is in one place, whatever the settings of the
process that enqueues more later, and a worker finds it whatever its own. A local directory must
then be shared by every node that runs the job's GPUs (S3 needs nothing more).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import redis
import zstandard

from dflash_tasks.core import jobs
from dflash_tasks.core.keys import JobName
from dflash_tasks.core.settings import Settings
from dflash_tasks.ledger.messages import decode_messages

MARK = b"@"
BODIES_DIR = "prompts"  # <job>/prompts/ under the location: the job's chunks and nothing else
_CHUNK_NAME = re.compile(r"chunk-(\d+)\.zst")


class ChunkStorage(Protocol):
    """What of output/storage.py's Storage the chunks need."""
    def put(self, key: str, data: bytes) -> None: ...
    def get_range(self, key: str, offset: int, length: int) -> bytes: ...
    def list(self, key_prefix: str) -> list[str]: ...
    def delete_keys(self, keys: list[str]) -> int: ...
    def location(self, key: str) -> str: ...


class BodyLost(ValueError):
    """The ledger cannot say where a prompt's body is (a reference that does not parse, a job
    that records no body location): no storage holds anything to wait for."""


class BodyCorrupt(ValueError):
    """The bytes a reference points to came back, but they are not a prompt's entry (not a zstd
    frame, not JSON, not a conversation): waiting will not mend them."""


def is_reference(stored: bytes) -> bool:
    return stored[:1] == MARK


def chunk_key(job: str, chunk: int) -> str:
    return f"{chunks_prefix(job)}chunk-{chunk:06d}.zst"


def chunks_prefix(job: str) -> str:
    return f"{job}/{BODIES_DIR}/"


def _chunk_number(key: str) -> int | None:
    """The number of the chunk a key names; None for anything else (a file being written)."""
    found = _CHUNK_NAME.fullmatch(key.rpartition("/")[2])
    return int(found.group(1)) if found else None


@dataclass(frozen=True, slots=True)
class Reference:
    chunk: int
    offset: int
    length: int

    def encode(self) -> bytes:
        return b"@%d:%d:%d" % (self.chunk, self.offset, self.length)

    @classmethod
    def parse(cls, stored: bytes) -> "Reference":
        try:
            chunk, offset, length = (int(part) for part in stored[1:].split(b":"))
        except ValueError:
            raise BodyLost(f"not a prompt body reference: {stored[:40]!r}") from None
        return cls(chunk, offset, length)


def job_location(r: redis.Redis, job: str, settings: Settings) -> str:
    """The job's body location: its own when it has one, else (its first `--bodies storage`
    enqueue) beside its batches, which becomes the job's."""
    found = jobs.load(r, job)
    beside = found.output if found is not None and found.output else settings.output_location()
    return jobs.body_location(r, job, wanted=beside)


class ChunkWriter:
    """The loader's way to store a chunk of frames (loader.py): a new chunk number each time,
    the object written before its references go to Redis, so no reference ever points at
    nothing. A chunk whose prompts were all known meanwhile is left unreferenced (harmless, and
    removed with the job)."""

    def __init__(self, r: redis.Redis, job: str, location: str, storage: ChunkStorage):
        self.r, self.job, self.location, self.storage = r, job, location, storage
        self.written: list[int] = []  # the chunks it stored: a failed new job removes them

    def __call__(self, frames: list[bytes]) -> list[bytes]:
        chunk = jobs.next_body_chunk(self.r, self.job)
        refs = write_chunk(self.storage, self.job, chunk, frames)
        self.written.append(chunk)
        return refs

    def remove_written(self) -> int:
        """Remove the chunks this writer stored, and only those (its enqueue failed, and its job
        is gone: a job of the same name made since has chunks of its own); returns how many."""
        return self.storage.delete_keys([chunk_key(self.job, chunk) for chunk in self.written])


def write_chunk(storage: ChunkStorage, job: str, chunk: int, frames: list[bytes]) -> list[bytes]:
    """Store `frames` as chunk number `chunk` of the job; returns each frame's reference."""
    refs, offset = [], 0
    for frame in frames:
        refs.append(Reference(chunk, offset, len(frame)).encode())
        offset += len(frame)
    storage.put(chunk_key(job, chunk), b"".join(frames))
    return refs


def read_frame(storage: ChunkStorage, job: str, stored: bytes) -> bytes:
    """The zstd frame a reference points to; the storage's errors as it raises them (a chunk
    not found, shorter than the reference, refused, or a storage that does not answer)."""
    ref = Reference.parse(stored)
    return storage.get_range(chunk_key(job, ref.chunk), ref.offset, ref.length)


def read_body(storage: ChunkStorage, job: str, stored: bytes) -> list | dict:
    """The entry a reference points to, decoded: a prompt's messages, or the {messages,
    continue} of a truncated row that regenerate --continue took back (ledger.TaskState.
    with_body). The storage's errors as read_frame raises them; BodyCorrupt, naming the chunk
    and the range, for bytes that are not such an entry."""
    ref = Reference.parse(stored)
    frame = storage.get_range(chunk_key(job, ref.chunk), ref.offset, ref.length)
    try:
        entry = decode_messages(frame)
    except (zstandard.ZstdError, ValueError) as exc:  # JSON's and UTF-8's errors are ValueErrors
        raise _corrupt(storage, job, ref, f"{type(exc).__name__}: {exc}") from None
    if not _is_entry(entry):
        raise _corrupt(storage, job, ref, f"JSON of the wrong shape: {str(entry)[:80]}")
    return entry


def _is_entry(entry) -> bool:
    """A conversation (a list of turns), or one kept with what its continuation needs."""
    if isinstance(entry, dict):
        entry = entry.get("messages")
    return isinstance(entry, list) and all(isinstance(turn, dict) for turn in entry)


def _corrupt(storage: ChunkStorage, job: str, ref: Reference, why: str) -> BodyCorrupt:
    return BodyCorrupt(f"{storage.location(chunk_key(job, ref.chunk))}: bytes {ref.offset} to "
                       f"{ref.offset + ref.length} are not a prompt's text ({why[:300]})")


def still_waits(r: redis.Redis, job: JobName, prompt_id: str, stored: bytes) -> bool:
    """Whether the prompt's entry is still this reference: not done, deleted with its job, or
    stored anew meanwhile (nothing then waits for these bytes)."""
    return r.hget(job.prompts, prompt_id) == stored


def remove_chunks(storage: ChunkStorage, job: str, through: int) -> int:
    """Remove a deleted job's chunks from its location's storage: those of its name numbered
    `through` or lower (jobs.Deleted), as a later job of that name numbers its own higher
    (jobs.next_body_chunk). Returns how many went."""
    numbered = ((key, _chunk_number(key)) for key in storage.list(chunks_prefix(job)))
    return storage.delete_keys([key for key, n in numbered if n is not None and n <= through])


def remove_entry_chunk(storage: ChunkStorage, job: str, stored: bytes) -> int:
    """Remove the chunk a reference points to, when it holds that one entry alone: a
    generation's entry handed on (tasks/generate.py), which nothing reads once the generation
    has gone on or ended. Returns how many objects went."""
    return storage.delete_keys([chunk_key(job, Reference.parse(stored).chunk)])
