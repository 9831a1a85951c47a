"""Bulk enqueue: a dataset's prompts into a job's ledger, a chunk per Lua call, pipelined.

The caller (the reader) parses the dataset; a sender thread writes each conversation's JSON,
compresses it (zstd releases the GIL) and waits on Redis, so reading chunk n+1 overlaps storing
chunk n, on the machine's other core. On a resume the sender first checks the chunk's ids
(`unknown_ids.lua`, ids only), and only the prompts the job does not know are encoded and sent:
enqueueing a dataset again costs one read of it, the checks overlapping the reading.
add_prompts.lua stays the authority (it checks again, atomically), so the check is only a
shortcut.

With `store_bodies` (`enqueue --bodies storage`, ledger/bodies.py) each chunk's frames go to the
output storage as one object, and Redis gets their references instead.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Iterable, Sequence

import redis

from dflash_tasks.core.keys import JobName
from dflash_tasks.ingest.prompts import Prompt
from dflash_tasks.ledger import Ledger
from dflash_tasks.ledger.messages import compress_many, messages_json

CHUNK = 1000   # prompts per add_prompts.lua call: ~0.7 MB, ~10 ms of Redis
DEPTH = 2      # chunks encoded ahead of the one Redis is storing


class PromptLoader:
    def __init__(self, client: redis.Redis, book: Ledger, job: JobName, *, resume: bool,
                 store_bodies: Callable[[list[bytes]], list[bytes]] | None = None,
                 on_stored: Callable[[int], object] | None = None):
        self.r, self.book, self.job = client, book, job
        self.resume = resume
        self.store_bodies = store_bodies
        self.on_stored = on_stored  # told how many prompts each chunk added, once it is stored
        self.added = 0
        self.sent = 0
        self._queue: queue.Queue = queue.Queue(maxsize=DEPTH)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._send_loop, name="enqueue-sender", daemon=True)
        self._thread.start()

    def add(self, prompts: Sequence[Prompt]) -> None:
        """Queue one chunk (at most a few thousand prompts) for storing."""
        self._raise_if_failed()
        if prompts:
            self._queue.put(list(prompts))

    def add_all(self, prompts: Iterable[Prompt], chunk: int = CHUNK, progress=None) -> int:
        batch: list[Prompt] = []
        for p in prompts:
            batch.append(p)
            if len(batch) == chunk:
                self.add(batch)
                if progress:
                    progress(len(batch))
                batch = []
        if batch:
            self.add(batch)
            if progress:
                progress(len(batch))
        return self.close()

    def close(self) -> int:
        """Wait until every queued chunk is stored; returns how many prompts were new."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._raise_if_failed()
        return self.added

    def keep_read(self) -> None:
        """Store the chunks already read, the dataset having failed further on (they are valid
        prompts, and a new job runs from its first chunk); if they cannot be stored, as
        abandon(): the dataset's error is the one the caller reports."""
        try:
            self.close()
        except Exception:
            pass

    def abandon(self) -> None:
        """Stop after the chunk being sent, dropping the rest (the caller is failing anyway)."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        try:
            self.close()
        except Exception:
            pass

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _send_loop(self) -> None:
        while (prompts := self._queue.get()) is not None:
            if self._error is not None:
                continue  # drain without sending after a failure
            try:
                if self.resume:
                    positions = self.book.unknown_positions(self.job, [p.id for p in prompts])
                    prompts = [prompts[i] for i in positions]
                if not prompts:
                    continue
                stored = compress_many([messages_json(p.messages).encode("utf-8") for p in prompts])
                if self.store_bodies is not None:
                    stored = self.store_bodies(stored)
                added = self.book.add_prompts(self.job, [(p.id, s) for p, s in zip(prompts, stored)])
                self.added += added
                self.sent += len(prompts)
                if self.on_stored is not None:
                    self.on_stored(added)
            except BaseException as exc:  # re-raised in the caller's thread
                self._error = exc
