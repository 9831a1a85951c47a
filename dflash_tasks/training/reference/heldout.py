"""train-eval: a checkpoint's acceptance on held-out prompts, reported as the papers do.

For each prompt, rendered with the chat template in the evaluation's thinking mode, the target
writes its own answer (greedy at temperature 0, else sampled), and the drafter's tau and
acceptance by block position are measured replaying speculative decoding along that answer
(speculation.py defines both). tau is the mean over prompts of each prompt's own tau, as z-lab's
DFlash benchmark (`dflash/benchmark.py`: the mean of each response's mean acceptance length) and
SpecForge report it; `tau_pooled`, beside it, is every prompt's tokens over every prompt's steps,
which weighs long answers more. Acceptance by position is pooled. A held-out prompt that is also
one of the training job's prompts is refused (`refuse_training_prompts`): the drafter has seen
the target's answer to it.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from dflash_tasks.training.data.gate import HeldOut
from dflash_tasks.training.data.thinking import run_thinking_mode
from dflash_tasks.training.data.tokens import ChatTemplate, row_thinking
from dflash_tasks.training.reference.config import EvalConfig
from dflash_tasks.training.reference.model import Drafter
from dflash_tasks.training.reference.speculation import Acceptance, continuation, measure

REPORT_FILE = "eval.json"


class EvalError(ValueError):
    """Bad input to train-eval; the message names the file, run or field."""


def check_thinking_contract(rows: Iterable[dict], settings: EvalConfig) -> bool:
    """THE place where a run's rows are checked against an evaluation's settings, before
    anything is measured; returns the thinking mode to evaluate in.

    The rows must hold one thinking mode (training/data/thinking.py: enable_thinking, the
    server's chat template fingerprint and reasoning parser, as each row recorded them), and
    [eval] enable_thinking, which defaults to the rows' own, must be theirs. The evaluation
    renders prompts with the target's own tokenizer here, so there is no server fingerprint to
    compare with the rows': that one is the gate's to hold constant across the rows."""
    rows = list(rows)
    modes = {row_thinking(row) for row in rows}
    wanted = settings.enable_thinking
    if wanted is None:
        if len(modes) != 1:
            raise EvalError("the run's rows mix thinking and non-thinking answers: set [eval] "
                            "enable_thinking (or --thinking / --no-thinking) to choose the mode "
                            "to evaluate in")
        mode = modes.pop()
    elif modes and modes != {wanted}:
        rows_mode = "thinking" if modes == {True} else \
            "non-thinking" if modes == {False} else "mixed"
        raise EvalError(f"the evaluation asks enable_thinking={str(wanted).lower()}, the run's "
                        f"rows are {rows_mode}: its tau would not say how the drafter does on "
                        "what it was trained for (set [eval] enable_thinking to the rows' mode)")
    else:
        mode = wanted
    try:
        run_thinking_mode(rows)  # the template and the parser the rows were generated with
    except ValueError as exc:
        raise EvalError(f"the run's rows do not hold one thinking mode: {exc}") from None
    return mode


def refuse_training_prompts(prompts: list, rows: Iterable[dict]) -> None:
    """EvalError when a held-out prompt is one of the training job's (gate.HeldOut), naming
    the first few and their rows."""
    check = HeldOut(prompts)
    for row in rows:
        check.see(row)
    if check.found:
        raise EvalError(f"{len(check.found)} of the {len(prompts)} held-out prompts are prompts "
                        f"of the training job: {check.named()}; the drafter was trained on the "
                        "target's answers to them, so their tau would measure memorisation: "
                        "hold out others")


def load_prompts(settings: EvalConfig) -> list:
    from dflash_tasks.ingest.prompts import DatasetError, ReadSummary, read_prompts

    path = Path(settings.prompts)
    if not path.is_file():
        raise EvalError(f"[eval] prompts: {path} is not a file (a JSONL or Parquet prompt "
                        "dataset, as enqueue reads)")
    summary = ReadSummary()
    try:
        prompts = list(read_prompts(path, settings.max_prompts, summary))
    except DatasetError as exc:
        raise EvalError(f"[eval] prompts: {exc}") from None
    if not prompts:
        first = f": {summary.bad[0].reason}" if summary.bad else ""
        raise EvalError(f"[eval] prompts: {path} holds no valid prompt{first}")
    return prompts


@torch.no_grad()
def evaluate(target: nn.Module, drafter: Drafter, template: ChatTemplate, prompts: list,
             settings: EvalConfig, thinking: bool,
             should_stop: Callable[[], bool] | None = None) -> dict:
    """The report: tau and acceptance by position pooled over the prompts, and per prompt."""
    started = time.monotonic()
    generator = torch.Generator().manual_seed(settings.seed)
    stops = [template.eot_id] + ([template.tokenizer.eos_token_id]
                                 if getattr(template.tokenizer, "eos_token_id", None) is not None
                                 else [])
    total, per_prompt = Acceptance(drafter.spec.block_size), []
    for prompt in prompts:
        ids = template.prompt_ids([dict(m) for m in prompt.messages], thinking)
        answer = continuation(target, ids, settings.max_new_tokens,
                              temperature=settings.temperature, stop_ids=stops,
                              generator=generator)
        counts = measure(target, drafter, ids + answer, len(ids))
        total.merge(counts)
        per_prompt.append({"id": prompt.id, "prompt_tokens": len(ids),
                           "answer_tokens": len(answer), "stopped": answer[-1] in stops,
                           "tau": counts.tau, "steps": counts.steps})
        if should_stop is not None and should_stop():
            break
    taus = [p["tau"] for p in per_prompt if p["tau"] is not None]
    return {**total.to_json(), "tau": statistics.fmean(taus) if taus else None,
            "tau_pooled": total.tau, "prompts": len(per_prompt),
            "temperature": settings.temperature, "enable_thinking": thinking,
            "max_new_tokens": settings.max_new_tokens, "prompts_file": settings.prompts,
            "duration_s": round(time.monotonic() - started, 1), "per_prompt": per_prompt}


def evaluate_checkpoint(checkpoint: str | Path, target: nn.Module, template: ChatTemplate,
                        settings: EvalConfig, thinking: bool, *, prompts: list | None = None,
                        report_path: Path | None = None,
                        should_stop: Callable[[], bool] | None = None) -> dict:
    """evaluate() of the drafter saved in `checkpoint`, its report written to report_path
    (default: beside it, checkpoint/eval.json) and returned."""
    from dflash_tasks.training.reference.checkpoints import STEP_DIR, load_drafter

    checkpoint = Path(checkpoint)
    drafter = load_drafter(checkpoint, target)
    report = evaluate(target, drafter, template,
                      prompts if prompts is not None else load_prompts(settings), settings,
                      thinking, should_stop)
    step = STEP_DIR.fullmatch(checkpoint.name)
    report = {"checkpoint": str(checkpoint), "step": int(step.group(1)) if step else None,
              **report}
    write_report(report, report_path or checkpoint / REPORT_FILE)
    return report


def write_report(report: dict, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.rename(path)


def summary(report: dict) -> dict:
    """What a run's hash keeps of a report (train-status): no per-prompt lines."""
    return {k: report.get(k) for k in ("checkpoint", "step", "tau", "tau_pooled",
                                       "acceptance_by_position",
                                       "steps", "prompts", "temperature", "enable_thinking",
                                       "block_size")}
