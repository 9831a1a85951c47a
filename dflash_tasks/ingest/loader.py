"""Bulk enqueue: a dataset's prompts into a job's ledger, a chunk per Lua call, pipelined.

The caller (the reader) parses and writes each conversation's JSON; a sender thread compresses it
(zstd releases the GIL) and waits on Redis, so reading chunk n+1 overlaps compressing and storing
chunk n, on the machine's other core. On a
resume the ids of each chunk are checked first (`unknown_ids.lua`, ids only), and only the prompts
the job does not know are encoded and sent: enqueueing a dataset again costs one read of it.
add_prompts.lua stays the authority (it checks again, atomically), so the check is only a
shortcut.
"""
from __future__ import annotations

import queue
import threading
from typing import Iterable, Sequence

import redis

from dflash_tasks.core.keys import JobKeys
from dflash_tasks.ingest.prompts import Prompt
from dflash_tasks.ledger import Ledger
from dflash_tasks.ledger.messages import compress_many, messages_json

CHUNK = 1000   # prompts per add_prompts.lua call: ~0.7 MB, ~10 ms of Redis
DEPTH = 2      # chunks encoded ahead of the one Redis is storing


class PromptLoader:
    def __init__(self, client: redis.Redis, book: Ledger, job: str, *, resume: bool):
        self.r, self.book, self.job = client, book, job
        self.keys = JobKeys(job)
        self.resume = resume
        self.added = 0
        self.sent = 0
        self._queue: queue.Queue = queue.Queue(maxsize=DEPTH)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._send_loop, name="enqueue-sender", daemon=True)
        self._thread.start()

    def add(self, prompts: Sequence[Prompt]) -> None:
        """Queue one chunk (at most a few thousand prompts) for storing."""
        self._raise_if_failed()
        if self.resume and prompts:
            positions = self.book.unknown_positions(self.job, [p.id for p in prompts])
            prompts = [prompts[i] for i in positions]
        if prompts:
            self._queue.put([(p.id, messages_json(p.messages).encode("utf-8")) for p in prompts])

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
        while (pairs := self._queue.get()) is not None:
            if self._error is not None:
                continue  # drain without sending after a failure
            try:
                frames = compress_many([data for _, data in pairs])
                pairs = [(pid, frame) for (pid, _), frame in zip(pairs, frames)]
                self.added += self.book.add_prompts(self.job, pairs)
                self.sent += len(pairs)
            except BaseException as exc:  # re-raised in the caller's thread
                self._error = exc
