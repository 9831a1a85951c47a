"""A torch IterableDataset over a job's shipped batches (a local directory or S3, through the
manifest), yielding tokenized training samples: `{"id", "input_ids", "loss_mask",
"attention_mask"}` (1-D int64 tensors), only for rows that pass the quality gate's rules; a
conversation whose every reply was generated gives one sample per reply (core/conversation.py).

    from dflash_tasks.training.torch_dataset import JobDataset
    ds = JobDataset("my-job", "s3://bucket/prefix", follow=True)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=4)

Work split. The manifest's batches, sorted by name (time order, append-only), are dealt out by
position: batch i goes to shard i mod (world_size * num_workers), where shard = rank *
num_workers + worker id. Every batch is read by exactly one DataLoader worker of one rank, so no
row is missed or read twice, and no worker downloads a batch it does not use. The rank and
world size come from torch.distributed when it is initialized, else from RANK/WORLD_SIZE, else
(0, 1); pass them explicitly to override. Ranks get batches, not rows, in equal numbers (+-1):
a DDP loop should stop all ranks at the shortest (torch's Join, or a fixed step count).

Following a running job (`follow=True`). The dataset reads progress.json (beside the batches),
then the manifest; it yields its share of batches not yet seen, and polls again every `poll_s`
until progress.json says the job is finished (done, or cancelled and settled) and every batch
listed at that moment is read. Since the manifest is written before progress.json says done,
nothing shipped is missed. `follow_timeout_s` bounds the wait for a batch that never comes.

The newest row per id, as every reader keeps it. A regenerated row replaces an older one with
the same id, usually in another shard's batch. Beat lists every row a regenerate replaced, by
batch, in <job>/superseded.json; each shard reads it with the manifest and skips those rows
("dropped:superseded"). A row whose id the shard has already yielded is skipped too
("dropped:duplicate"). Following a running job, a row yielded before a regenerate replaced it
cannot be taken back: regenerate before the training run starts, or train from a finished job.
"""
from __future__ import annotations

import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info

from dflash_tasks.core.conversation import reply_rows
from dflash_tasks.core.settings import get_settings
from dflash_tasks.output.batches import read_batch
from dflash_tasks.output.progress import read_progress
from dflash_tasks.output.storage import (
    LocalStorage,
    Storage,
    storage_at,
    storage_for,
)
from dflash_tasks.training.data.gate import Rules, check_row
from dflash_tasks.training.data.reader import (
    InvalidManifest,
    NoManifest,
    job_storage,
    manifest_records,
    superseded_rows,
)
from dflash_tasks.training.data.tokens import ChatTemplate, TokenizeError, tokenize_row

log = logging.getLogger(__name__)

PAD_ID = 151643  # Qwen3's <|endoftext|>


def job_finished(progress: dict | None) -> bool:
    """progress.json says no batch will be added: done, or cancelled with nothing left."""
    if not progress:
        return False
    status = progress.get("status")
    if status == "done":
        return True
    return status == "cancelled" and not progress.get("in_flight") and \
        not progress.get("unsealed_rows") and progress.get("sealing_batch") is None


class FollowStopped(Exception):
    """Following a job was stopped by `should_stop` while waiting for a batch."""


class JobDataset(IterableDataset):
    def __init__(self, job: str, source: str | Path | Storage | None = None, *,
                 rules: Rules | None = None, tokenizer: str | Path | ChatTemplate | None = None,
                 follow: bool = False, poll_s: float = 5.0, follow_timeout_s: float | None = None,
                 rank: int | None = None, world_size: int | None = None, tensors: bool = True,
                 should_stop: Callable[[], bool] | None = None):
        """`source`: an s3:// URI, a directory, a Storage, or None for DFLASH_S3_URI or else
        DFLASH_OUTPUT_DIR. `tokenizer`: the target tokenizer's directory, used only for rows
        without server token ids (skipped and counted when there is none). `should_stop`:
        asked every second while following waits for a batch; True raises FollowStopped (a
        training run cancelled while the job it follows is slow)."""
        super().__init__()
        if (rank is None) != (world_size is None):
            raise ValueError("pass both rank and world_size, or neither")
        if rank is not None and not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.job, self.source = job, source
        self.rules = rules or Rules()
        self.tokenizer = tokenizer
        self.follow, self.poll_s, self.follow_timeout_s = follow, poll_s, follow_timeout_s
        self.rank, self.world_size = rank, world_size
        self.tensors = tensors
        self.should_stop = should_stop
        self.stats: Counter = Counter()  # of the last iteration in this process

    # -- where and who ---------------------------------------------------------------------------

    def _storage(self) -> Storage:
        """The job's storage; a directory written by `manage.py export` works too."""
        if self.source is None:
            return storage_for(get_settings())
        if isinstance(self.source, (str, Path)):
            if str(self.source).startswith("s3://"):
                return storage_at(str(self.source), get_settings())
            return LocalStorage(Path(self.source))
        return self.source

    def _template(self) -> ChatTemplate | None:
        if self.tokenizer is None or isinstance(self.tokenizer, ChatTemplate):
            return self.tokenizer
        return ChatTemplate.load(self.tokenizer)

    def rank_world(self) -> tuple[int, int]:
        if self.rank is not None:
            return self.rank, self.world_size
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))

    def shard(self) -> tuple[int, int]:
        """(this reader's shard, number of shards)."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rank, world = self.rank_world()
        return rank * workers + worker, world * workers

    # -- reading ---------------------------------------------------------------------------------

    def _progress(self, storage: Storage) -> dict | None:
        return read_progress(storage, self.job)

    def _records(self, storage: Storage, parts: dict) -> list[dict]:
        try:
            return manifest_records(storage, self.job, parts)
        except InvalidManifest:
            raise  # waiting would not make it valid
        except NoManifest:
            if self.follow:
                return []  # nothing shipped yet
            raise

    def __iter__(self) -> Iterator[dict]:
        shard, shards = self.shard()
        storage, template = job_storage(self._storage(), self.job), self._template()
        self.stats = Counter()
        known: list[str] = []
        seen: set[str] = set()
        parts: dict = {}  # the manifest's full parts, read once
        last_new = time.monotonic()
        while True:
            finished = self.follow and job_finished(self._progress(storage))  # before the manifest
            records = self._records(storage, parts)
            names = [rec["name"] for rec in records]
            if names[:len(known)] != known:
                raise RuntimeError(f"job {self.job}: the manifest's batches changed order or "
                                   "lost a batch while it was being read")
            fresh = list(enumerate(records))[len(known):]
            known = names
            if fresh:
                last_new = time.monotonic()
            superseded = superseded_rows(storage, self.job) if fresh else {}
            for position, rec in fresh:
                if position % shards == shard:
                    yield from self._batch(storage, rec, template, seen,
                                           superseded.get(rec["name"], frozenset()))
            if not self.follow or finished:
                return
            if self.follow_timeout_s is not None and \
                    time.monotonic() - last_new > self.follow_timeout_s:
                raise TimeoutError(f"job {self.job}: no new batch for {self.follow_timeout_s:g}s "
                                   "and the job is not finished")
            self._wait(self.poll_s)

    def _wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.should_stop is not None and self.should_stop():
                raise FollowStopped(f"job {self.job}: stopped while waiting for its next batch")
            time.sleep(min(left, 1.0))

    def _batch(self, storage: Storage, rec: dict, template: ChatTemplate | None,
               seen: set[str], superseded: frozenset[str]) -> Iterator[dict]:
        self.stats["batches"] += 1
        for row in read_batch(storage, rec):
            self.stats["rows"] += 1
            rid = str(row.get("id"))
            if rid in superseded:
                self.stats["dropped:superseded"] += 1
                continue
            if rid in seen:
                self.stats["dropped:duplicate"] += 1
                continue
            kept = False
            for sample in self._samples(reply_rows(row), template):
                kept = True
                yield sample
            if kept:  # a copy dropped by the rules leaves a later one its chance
                seen.add(rid)

    def _samples(self, rows: list[dict], template: ChatTemplate | None) -> Iterator[dict]:
        """The samples of one row (a conversation's: one per reply, core/conversation.py)."""
        for row in rows:
            rid = str(row.get("id"))
            try:
                tok = tokenize_row(row, template)
            except TokenizeError:
                tok = None
            check = check_row(row, tok, self.rules)
            reason = self.rules.drop_reason(check.flags)
            if reason:
                self.stats[f"dropped:{reason}"] += 1
                continue
            self.stats["yielded"] += 1
            if check.cut_tokens:  # longer than max_length: its first max_length tokens
                tok = self.rules.trained(tok)
                self.stats["cut"] += 1
                self.stats["cut_tokens"] += check.cut_tokens
            if not self.tensors:
                yield {"id": rid, "input_ids": tok.input_ids, "loss_mask": tok.loss_mask}
                continue
            yield {"id": rid,
                   "input_ids": torch.tensor(tok.input_ids, dtype=torch.long),
                   "loss_mask": torch.tensor(tok.loss_mask, dtype=torch.long),
                   "attention_mask": torch.ones(len(tok.input_ids), dtype=torch.long)}


def pad_collate(samples: list[dict], pad_id: int = PAD_ID) -> dict:
    """A DataLoader collate_fn: right-pads a list of samples into [batch, longest] tensors
    (padding has attention_mask 0 and loss_mask 0)."""
    longest = max(len(s["input_ids"]) for s in samples)
    out = {"id": [s["id"] for s in samples]}
    for key, fill in (("input_ids", pad_id), ("loss_mask", 0), ("attention_mask", 0)):
        batch = torch.full((len(samples), longest), fill, dtype=torch.long)
        for i, s in enumerate(samples):
            batch[i, :len(s[key])] = s[key]
        out[key] = batch
    return out
