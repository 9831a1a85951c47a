"""The reference trainer on several processes: `torchrun --nproc_per_node N -m
dflash_tasks.training.reference ...` (one process per GPU; gloo on CPU). The drafter is wrapped
in DistributedDataParallel; every process reads the job's rows in the same seeded order and
trains on its own share of each global batch of N x batch_size samples; rank 0 writes the
checkpoints, with every rank's random state, so a run resumed after SIGKILL goes on exactly as
the uninterrupted one (tests/test_training_distributed.py).

Every process reads every batch of the job (the order is the data's and the seed's alone, so
no rank can run short of samples and hang the others at the end of an epoch): the reading
costs N times, the training is shared."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def join() -> Ranks:
    """torchrun's process group when it started this process (WORLD_SIZE > 1): nccl on CUDA,
    gloo on CPU; else one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Ranks()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return Ranks(dist.get_rank(), dist.get_world_size())


def device_for(ranks: Ranks, name: str) -> str:
    """The process's device: with several processes on CUDA, its local rank's GPU."""
    if ranks.distributed and name in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return name


def gathered(value, ranks: Ranks) -> list:
    """Every rank's `value`, in rank order, on every rank (a collective: all ranks call it)."""
    if not ranks.distributed:
        return [value]
    out: list = [None] * ranks.world
    dist.all_gather_object(out, value)
    return out


def barrier(ranks: Ranks) -> None:
    if ranks.distributed:
        dist.barrier()
