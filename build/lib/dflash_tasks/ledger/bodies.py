"""Prompt bodies kept on the output storage instead of in Redis (`enqueue --bodies storage`).

At ten million prompts the bodies alone would take 7.5 GB of Redis (about 750 B each, compressed).
With this store the enqueue writes each chunk of prompts as one object of concatenated zstd frames,
`<job>/prompts/chunk-<n>.zst` under the job's body location, and the `prompts` hash holds a
reference of about 20 bytes per prompt instead of its frame:

    @<chunk>:<offset>:<length>

which no stored conversation starts with (a zstd frame starts with its magic number, JSON with
`[` or `{`). The worker reads exactly those bytes back (a file read at an offset, or an S3 ranged
GET) and decodes them as `messages.decode_messages` does any stored frame. The storage itself
(output/storage.py, a stage above) is given to these functions by their callers.

The location (an absolute directory or an s3:// URI) is the job's, fixed by its first such enqueue
(`jobs.body_location`): every chunk of a job is in one place, whatever the settings of the
process that enqueues more later, and a worker finds it whatever its own. A local directory must
then be shared by every node that runs the job's GPUs (S3 needs nothing more).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import redis

from dflash_tasks.core import jobs
from dflash_tasks.core.settings import Settings

MARK = b"@"
BODIES_DIR = "prompts"  # <job>/prompts/ under the location: the job's chunks and nothing else


class ChunkStorage(Protocol):
    """What of output/storage.py's Storage the chunks need."""
    def put(self, key: str, data: bytes) -> None: ...
    def get_range(self, key: str, offset: int, length: int) -> bytes: ...
    def delete_prefix(self, key_prefix: str) -> int: ...


def is_reference(stored: bytes) -> bool:
    return stored[:1] == MARK


def chunk_key(job: str, chunk: int) -> str:
    return f"{job}/{BODIES_DIR}/chunk-{chunk:06d}.zst"


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
            raise ValueError(f"not a prompt body reference: {stored[:40]!r}") from None
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
        self.written = 0  # chunks stored so far: a failed new job removes them, if any

    def __call__(self, frames: list[bytes]) -> list[bytes]:
        refs = write_chunk(self.storage, self.job, jobs.next_body_chunk(self.r, self.job), frames)
        self.written += 1
        return refs


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
    that is gone, or a storage that does not answer)."""
    ref = Reference.parse(stored)
    return storage.get_range(chunk_key(job, ref.chunk), ref.offset, ref.length)


def remove_chunks(storage: ChunkStorage, job: str) -> int:
    """Remove every chunk of the job from its location's storage; returns how many went."""
    return storage.delete_prefix(f"{job}/{BODIES_DIR}/")
