"""The training loop: a job's samples in, drafter checkpoints and metrics out, resumable."""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from dflash_tasks.output.storage import Storage
from dflash_tasks.training.data.tokens import ChatTemplate
from dflash_tasks.training.reference.blocks import (
    IGNORE,
    build_blocks,
    chunked_block_loss,
    position_accuracy,
    sample_anchors,
)
from dflash_tasks.training.reference.checkpoints import (
    latest_checkpoint,
    load_state,
    load_weights,
    read_spec,
    save_checkpoint,
)
from dflash_tasks.training.reference.config import TrainConfig
from dflash_tasks.training.reference.data import epoch_batches, job_dataset
from dflash_tasks.training.reference.distributed import Ranks, barrier, device_for, gathered, join
from dflash_tasks.training.reference.model import Drafter, DrafterSpec, block_hidden, logits
from dflash_tasks.training.reference.target import (
    layer_ids,
    load_target,
    mask_token_id,
    pick_device,
    target_hidden,
)
from dflash_tasks.training.torch_dataset import FollowStopped, pad_collate

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class TrainResult:
    status: str                 # "done" (max_steps or epochs reached) or "stopped" (should_stop)
    step: int                   # the last step trained, counted over all resumes
    checkpoints: list[Path]     # checkpoint directories written by this call (the older ones
                                # may since have been deleted: keep_checkpoints)
    last_metrics: dict          # the last metrics line of this call ({} if it trained no step)


@dataclass
class Progress:
    """Where the run is; saved in every checkpoint."""
    step: int = 0
    epoch: int = 0
    epoch_samples: int = 0      # samples of the current epoch already trained on
    samples: int = 0            # in all epochs
    elapsed_s: float = 0.0      # wall time of the steps, over all resumes


def lr_factor(i: int, warmup: int, max_steps: int) -> float:
    """Multiplier of the learning rate for the (i + 1)-th step: linear warmup, then a cosine
    to 0 at max_steps."""
    if i < warmup:
        return (i + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (i - warmup) / max(1, max_steps - warmup))))


@dataclass
class Window:
    """Sums over the steps since the last metrics line."""
    block_size: int
    steps: int = 0
    loss: float = 0.0
    correct: torch.Tensor = field(init=False)
    total: torch.Tensor = field(init=False)
    lr: float = 0.0             # of the last step
    epoch: int = 0              # of the last step
    start: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.correct = torch.zeros(self.block_size, dtype=torch.long)
        self.total = torch.zeros(self.block_size, dtype=torch.long)


def _rng_state(anchor_rng: torch.Generator) -> dict:
    state = {"torch": torch.get_rng_state(), "anchors": anchor_rng.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict | list, anchor_rng: torch.Generator, ranks: Ranks) -> None:
    """A checkpoint's random state: one per rank (a list, in rank order) since the trainer ran
    on several processes; a single dict before, that of a one-process run."""
    if isinstance(state, list):
        if len(state) != ranks.world:
            raise ValueError(f"the checkpoint was written by {len(state)} process(es) and this "
                             f"run has {ranks.world}: resume it with --nproc_per_node "
                             f"{len(state)} (its data and random state are shared that way)")
        state = state[ranks.rank]
    elif ranks.distributed:
        raise ValueError(f"the checkpoint was written by one process and this run has "
                         f"{ranks.world}: resume it in one process")
    torch.set_rng_state(state["torch"])
    anchor_rng.set_state(state["anchors"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class _Run:
    """One call of `train`: the models, the optimizer, where the run is, and its outputs."""

    def __init__(self, config: TrainConfig, run_dir: Path, say: Callable[[str], None],
                 on_metrics: Callable[[dict], None] | None,
                 on_checkpoint: Callable[[Path, nn.Module], None] | None = None):
        self.ranks = join()
        # rank 0 speaks for the run: with several processes the others' lines would repeat it
        self.say = say if self.ranks.main else (lambda _line: None)
        self.config, self.run_dir, self.on_metrics = config, run_dir, on_metrics
        self.on_checkpoint = on_checkpoint
        self.device = pick_device(device_for(self.ranks, config.device))
        self.target = load_target(config.target_model, dtype=DTYPES[config.dtype],
                                  device=self.device)
        tokenizer_dir = config.tokenizer_dir()
        self.template = ChatTemplate.load(tokenizer_dir) if tokenizer_dir else None
        tconf = self.target.config
        self.layers = layer_ids(config, tconf.num_hidden_layers)
        self.spec = DrafterSpec.from_target(
            tconf, num_layers=config.drafter_layers, target_layer_ids=self.layers,
            block_size=config.block_size, target_model=config.target_model,
            mask_token_id=mask_token_id(config, self.template and self.template.tokenizer,
                                        self.target.get_input_embeddings().num_embeddings))
        torch.manual_seed(config.seed)
        # float32 whatever the target's dtype: AdamW updates on bf16 weights lose small steps
        self.drafter = Drafter(self.spec).to(self.device)
        # what the step calls: the drafter itself, or with several processes DDP around it
        # (gradients averaged over the ranks; the same start on every rank, the same seed)
        self.model: nn.Module = self.drafter if not self.ranks.distributed else \
            torch.nn.parallel.DistributedDataParallel(self.drafter)
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=config.learning_rate,
                                           weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            partial(lr_factor, warmup=config.warmup_steps, max_steps=config.max_steps))
        # each rank draws its own anchors (rank 0 as a one-process run does)
        self.anchor_rng = torch.Generator().manual_seed(config.seed + 1_000_003 * self.ranks.rank)
        self.progress = Progress()
        self.written: list[Path] = []
        self.last_metrics: dict = {}
        say(f"target {config.target_model}: {tconf.num_hidden_layers} layers, hidden "
            f"{tconf.hidden_size}; drafter {self.spec.num_layers} layer(s) fed by target layers "
            f"{self.layers}, block {self.spec.block_size}, mask id {self.spec.mask_token_id}, "
            f"{sum(p.numel() for p in self.drafter.parameters()):,} parameters, on {self.device}")

    def resume(self) -> None:
        """Continue from the newest checkpoint in run_dir, if there is one; start the clocks."""
        checkpoint = latest_checkpoint(self.run_dir)
        if checkpoint is not None:
            saved, now = read_spec(checkpoint).to_json(), self.spec.to_json()
            # the target may have moved; the drafter must be the same (a field an older
            # checkpoint did not record is the target's, not the drafter's)
            differ = [k for k in now if k != "target_model" and saved.get(k) is not None
                      and saved.get(k) != now[k]]
            if differ:
                k = differ[0]
                raise ValueError(f"cannot resume from {checkpoint}: its drafter has {k} "
                                 f"{saved.get(k)!r}, this config gives {now[k]!r} (use "
                                 "another run directory)")
            load_weights(self.drafter, checkpoint)
            state = load_state(checkpoint)
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.progress = Progress(**state["progress"])
            _restore_rng(state["rng"], self.anchor_rng, self.ranks)
            self.say(f"resumed from {checkpoint}: step {self.progress.step}, epoch "
                     f"{self.progress.epoch}, {self.progress.epoch_samples} samples into it")
        self.saved_step = self.progress.step
        self.started, self.elapsed_before = time.monotonic(), self.progress.elapsed_s
        self.window = Window(self.spec.block_size)

    def step(self, samples: list[dict]) -> None:
        """One optimizer step on a batch of samples."""
        spec, window, progress = self.spec, self.window, self.progress
        window.lr, window.epoch = self.optimizer.param_groups[0]["lr"], progress.epoch
        batch = {k: v.to(self.device) for k, v in pad_collate(samples).items() if k != "id"}
        hidden = target_hidden(self.target, batch["input_ids"], batch["attention_mask"],
                               self.layers)
        anchors, keep = sample_anchors(batch["loss_mask"], self.config.anchors_per_sequence,
                                       self.anchor_rng)
        blocks = build_blocks(batch["input_ids"], batch["loss_mask"], batch["attention_mask"],
                              anchors, keep, block_size=spec.block_size,
                              mask_token_id=spec.mask_token_id, gamma=self.config.decay())
        out = block_hidden(self.target, self.drafter, hidden, blocks.input_ids, blocks.positions,
                           blocks.mask, forward=self.model)
        # project to the vocabulary only where there is a label, and a chunk of positions at a
        # time: logits are [positions, 151,936]
        labelled = blocks.labels != IGNORE
        k = torch.arange(blocks.labels.shape[1], device=self.device) % spec.block_size
        loss, correct, total = chunked_block_loss(
            partial(logits, self.target), out[labelled], blocks.labels[labelled],
            blocks.weights[labelled], k.expand_as(labelled)[labelled], spec.block_size,
            self.config.loss_chunk)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.scheduler.step()

        progress.step += 1
        progress.epoch_samples += len(samples) * self.ranks.world  # the global batch's
        progress.samples += len(samples) * self.ranks.world
        progress.elapsed_s = self.elapsed_before + time.monotonic() - self.started
        window.steps += 1
        window.loss += loss.item()
        window.correct += correct
        window.total += total

    def flush(self) -> None:
        """The metrics of the steps since the last line: to metrics.jsonl, on_metrics, the log."""
        window, seconds = self.window, max(time.monotonic() - self.window.start, 1e-9)
        tokens = int(window.total.sum())
        accuracy = int(window.correct.sum()) / tokens if tokens else None
        self.last_metrics = {
            "step": self.progress.step, "epoch": window.epoch, "loss": window.loss / window.steps,
            "accuracy": accuracy,
            "accuracy_by_position": position_accuracy(window.correct, window.total),
            "tokens_per_s": tokens / seconds, "lr": window.lr, "samples": self.progress.samples,
            "elapsed_s": self.progress.elapsed_s}
        self.window = Window(self.spec.block_size)
        if not self.ranks.main:  # rank 0 speaks for the run (its own share's figures)
            return
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(self.last_metrics) + "\n")
        if self.on_metrics:
            self.on_metrics(self.last_metrics)
        self.say(f"step {self.progress.step} epoch {window.epoch} loss "
                 f"{self.last_metrics['loss']:.4f} accuracy "
                 f"{'-' if accuracy is None else f'{accuracy:.3f}'} "
                 f"{tokens / seconds:,.0f} tokens/s lr {window.lr:.3g}")

    def save(self) -> None:
        """Every rank calls it (its random state is gathered); rank 0 writes the checkpoint."""
        rng = gathered(_rng_state(self.anchor_rng), self.ranks)
        if self.ranks.main:
            state = {"optimizer": self.optimizer.state_dict(),
                     "scheduler": self.scheduler.state_dict(),
                     "progress": asdict(self.progress),
                     "rng": rng if self.ranks.distributed else rng[0]}
            self.written.append(save_checkpoint(self.run_dir, self.progress.step, self.drafter,
                                                state, self.config.keep_checkpoints))
            self.say(f"checkpoint {self.written[-1]}")
            if self.on_checkpoint:
                self.on_checkpoint(self.written[-1], self.target)
        self.saved_step = self.progress.step
        barrier(self.ranks)  # no rank reads a checkpoint rank 0 has not finished

    def finished(self) -> bool:
        epochs = self.config.epochs
        return self.progress.step >= self.config.max_steps or \
            (epochs is not None and self.progress.epoch >= epochs)


def train(config: TrainConfig, *, job: str, source: str | Path | Storage, run_dir: str | Path,
          follow: bool = False, on_metrics: Callable[[dict], None] | None = None,
          should_stop: Callable[[], bool] | None = None,
          log: Callable[[str], None] | None = None,
          on_checkpoint: Callable[[Path, nn.Module], None] | None = None) -> TrainResult:
    """Train a drafter on `job`'s rows read from `source` (a directory, an s3:// URI or a
    Storage), writing metrics.jsonl and checkpoints under run_dir; resumes from the newest
    checkpoint there. `follow`: keep reading a running job's new batches (first epoch), as
    JobDataset does. `should_stop` is asked after every step, and every second while following
    waits for a batch: True saves and returns "stopped". `on_checkpoint(path, target)` is
    called after each checkpoint is written (train-eval's measure, with the loaded target)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    run = _Run(config, run_dir, log or logger.info, on_metrics, on_checkpoint)
    run.resume()
    progress, status = run.progress, "done"
    if follow and run.ranks.distributed:
        raise ValueError("a running job is followed by one process: train on a finished job "
                         "with several")
    while not run.finished() and status == "done":
        dataset = job_dataset(config, job, source, run.template, follow and progress.epoch == 0,
                              should_stop)
        try:
            for samples in epoch_batches(dataset, config, progress.epoch,
                                         skip=progress.epoch_samples, ranks=run.ranks):
                run.step(samples)
                stop = should_stop is not None and should_stop()
                if progress.step % config.log_every == 0 or stop or run.finished():
                    run.flush()
                if progress.step % config.checkpoint_every == 0:
                    run.save()
                if stop:
                    status = "stopped"
                    break
                if run.finished():
                    break
            else:  # the epoch is exhausted
                if dataset.stats["yielded"] == 0:
                    raise RuntimeError(f"job {job}: no row passed the rules in epoch "
                                       f"{progress.epoch} ({dict(dataset.stats)})")
                run.say(f"epoch {progress.epoch} done: {dict(dataset.stats)}")
                progress.epoch += 1
                progress.epoch_samples = 0
        except FollowStopped:  # stopped while the followed job had no new batch
            status = "stopped"
    if run.window.steps:  # the last epoch ended between two metrics lines
        run.flush()
    if progress.step > run.saved_step:
        run.save()
    return TrainResult(status, progress.step, run.written, run.last_metrics)


@dataclass
class Overfitted:
    target: nn.Module
    drafter: Drafter
    last_metrics: dict


def overfit(config: TrainConfig, samples: list[dict], *, work_dir: str | Path,
            log: Callable[[str], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> Overfitted:
    """A fresh drafter trained on `samples` alone, in batches of config.batch_size taken round
    and round, for config.max_steps steps, by the very step `train` takes (the smoke gate).
    Metrics go to work_dir/metrics.jsonl; no checkpoint is written. `should_stop` is asked
    after every step: True ends the training there."""
    if not samples:
        raise ValueError("overfit: no samples")
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / "metrics.jsonl").unlink(missing_ok=True)
    run = _Run(config, work_dir, log or logger.info, None)
    run.window = Window(run.spec.block_size)
    run.started, run.elapsed_before = time.monotonic(), 0.0
    for i in range(config.max_steps):
        first = i * config.batch_size
        run.step([samples[(first + j) % len(samples)] for j in range(config.batch_size)])
        if run.progress.step % config.log_every == 0:
            run.flush()
        if should_stop is not None and should_stop():
            break
    if run.window.steps:
        run.flush()
    return Overfitted(run.target, run.drafter.eval(), run.last_metrics)
