"""The overfit gate, run before a real training run: the configured drafter trains on a handful
of the job's rows, and must then nearly fill its blocks replaying those very rows.

A drafter that can memorise four rows gets almost every draft accepted on them, so its mean
acceptance length tau approaches the block size; one trained with a broken attention mask or a
label shifted by one stays near 1 however long it trains, because what it learns is not what
the target verifies. Minutes of this catch what days of training would otherwise reveal.

Acceptance is measured along the rows themselves (the tokens the drafter was trained to
predict), with the same replay and definition of tau as train-eval (speculation.py).
"""
from __future__ import annotations

import time
from itertools import islice
from pathlib import Path
from typing import Callable

from dflash_tasks.output.storage import Storage
from dflash_tasks.training.data.tokens import ChatTemplate
from dflash_tasks.training.reference.config import SmokeConfig, TrainConfig
from dflash_tasks.training.reference.data import job_dataset
from dflash_tasks.training.reference.speculation import Acceptance, measure


class SmokeFailed(RuntimeError):
    """The overfit gate failed; the message says by how much and what it suggests."""


def first_samples(config: TrainConfig, job: str, source: str | Path | Storage, n: int,
                  template: ChatTemplate | None) -> list[dict]:
    """The first n samples of the job that pass the trainer's rules, in batch order."""
    dataset = job_dataset(config, job, source, template, follow=False)
    samples = list(islice(iter(dataset), n))
    if not samples:
        raise SmokeFailed(f"job {job}: no row passes the trainer's rules "
                          f"({dict(dataset.stats)}): nothing to overfit")
    return samples


def response_start(loss_mask) -> int:
    """Where a sample's answer starts: its first supervised position (at least 1)."""
    mask = [int(v) for v in loss_mask]
    return max(1, mask.index(1)) if 1 in mask else len(mask) - 1


def smoke_gate(config: TrainConfig, smoke: SmokeConfig, *, job: str,
               source: str | Path | Storage, work_dir: str | Path,
               log: Callable[[str], None] = print,
               should_stop: Callable[[], bool] | None = None) -> dict:
    """Overfit `smoke.rows` rows of the job for `smoke.steps` steps and measure tau on them.
    Returns the verdict ({"passed", "tau", "min_tau", "acceptance_by_position", ...}); it is
    the caller's to refuse the run when it did not pass."""
    from dflash_tasks.training.reference.trainer import overfit

    started = time.monotonic()
    overrides = {"max_steps": smoke.steps, "log_every": max(1, smoke.steps // 5)}
    if smoke.learning_rate is not None:
        overrides["learning_rate"] = smoke.learning_rate
    cfg = config.model_copy(update=overrides)
    tokenizer_dir = cfg.tokenizer_dir()
    template = ChatTemplate.load(tokenizer_dir) if tokenizer_dir else None
    samples = first_samples(cfg, job, source, smoke.rows, template)
    threshold = smoke.threshold(cfg.block_size)
    log(f"smoke gate: overfitting {len(samples)} row(s) of job {job} for {smoke.steps} steps; "
        f"it passes at tau >= {threshold:g} (block size {cfg.block_size})")
    fitted = overfit(cfg, samples, work_dir=work_dir, log=log, should_stop=should_stop)
    counts = Acceptance(cfg.block_size)
    for sample in samples:
        counts.merge(measure(fitted.target, fitted.drafter, sample["input_ids"],
                             response_start(sample["loss_mask"])))
    tau = counts.tau or 1.0
    verdict = {"passed": tau >= threshold, "tau": tau, "min_tau": threshold,
               "block_size": cfg.block_size, "rows": len(samples), "steps": smoke.steps,
               "acceptance_by_position": counts.by_position(),
               "loss": fitted.last_metrics.get("loss"),
               "duration_s": round(time.monotonic() - started, 1)}
    log(f"smoke gate {'passed' if verdict['passed'] else 'FAILED'}: tau {tau:.2f} of "
        f"{cfg.block_size} (needs {threshold:g}) on {len(samples)} row(s) after {smoke.steps} "
        f"steps, loss {verdict['loss']:.4f}; acceptance by position "
        + " ".join(f"{a:.2f}" for a in counts.by_position() if a is not None))
    return verdict


def failure_message(verdict: dict) -> str:
    return (f"the smoke gate failed: tau {verdict['tau']:.2f} < {verdict['min_tau']:g} on "
            f"{verdict['rows']} row(s) it trained on for {verdict['steps']} steps (block size "
            f"{verdict['block_size']}): a drafter that cannot memorise a handful of rows has a "
            "broken mask, label shift or learning rate ([smoke] steps, learning_rate)")
