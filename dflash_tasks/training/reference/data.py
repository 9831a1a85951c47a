"""The trainer's input: one epoch of a job's samples through the dataset's rules, shuffled by a
seeded buffer, in batches. The order depends only on the data and (seed, epoch), so a resumed
run that skips the samples it already consumed sees exactly what the interrupted one would
have seen next."""
from __future__ import annotations

from itertools import islice
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from dflash_tasks.output.storage import Storage
from dflash_tasks.training.data.tokens import ChatTemplate
from dflash_tasks.training.reference.config import TrainConfig
from dflash_tasks.training.reference.distributed import Ranks
from dflash_tasks.training.torch_dataset import JobDataset


def shuffled(samples: Iterable[dict], size: int, generator: torch.Generator) -> Iterator[dict]:
    """A shuffle buffer: hold up to `size` samples, emit a random one as each new one arrives
    (then drain at random). Streams of any length, memory bounded by `size`."""
    buffer: list[dict] = []

    def pop() -> dict:
        i = int(torch.randint(len(buffer), (1,), generator=generator))
        buffer[i], buffer[-1] = buffer[-1], buffer[i]
        return buffer.pop()

    for sample in samples:
        buffer.append(sample)
        if len(buffer) >= size:
            yield pop()
    while buffer:
        yield pop()


def job_dataset(config: TrainConfig, job: str, source: str | Path | Storage,
                template: ChatTemplate | None, follow: bool,
                should_stop: Callable[[], bool] | None = None) -> JobDataset:
    # rank 0 of 1 whatever RANK/WORLD_SIZE say: this trainer is one process and reads every batch
    return JobDataset(job, source, rules=config.rules(),
                      tokenizer=template, follow=follow, poll_s=config.poll_s,
                      rank=0, world_size=1, should_stop=should_stop)


def epoch_batches(dataset: JobDataset, config: TrainConfig, epoch: int, skip: int = 0,
                  ranks: Ranks = Ranks()) -> Iterator[list[dict]]:
    """Lists of up to batch_size samples of one epoch, the first `skip` samples left out. With
    several processes, every process reads the one stream in global batches of world x
    batch_size samples and takes its rank's share; a last global batch too short to give every
    rank a whole share is left out, so that the ranks step together."""
    generator = torch.Generator().manual_seed(config.seed + epoch)
    stream = islice(shuffled(dataset, config.shuffle_buffer, generator), skip, None)
    size = config.batch_size * ranks.world
    while batch := list(islice(stream, size)):
        if not ranks.distributed:
            yield batch
        elif len(batch) == size:
            yield batch[ranks.rank * config.batch_size:(ranks.rank + 1) * config.batch_size]
