"""The reference trainer's settings (`TrainConfig`) and reading them from a .toml or .json file.

Checks that need the target model (layer ids below its depth, the mask id inside its
vocabulary) are made when it is loaded (`target.py`); everything else is checked here.
"""
from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dflash_tasks.training.data.gate import Rules

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # the frozen target: a local directory in Hugging Face format (nothing is downloaded)
    target_model: str
    # tokenizer for rows without server token ids; None: the target directory when it holds one
    tokenizer: str | None = None

    # the drafter and its objective
    block_size: int = Field(16, ge=2)
    # z-lab's published drafters: 5 layers fed by 5 target layers ([1, 9, 17, 25, 33] of
    # Qwen3-8B's 36, as target.default_layer_ids spreads them)
    drafter_layers: int = Field(5, ge=1)
    target_layer_ids: list[int] | None = None  # None: one per drafter layer, spread evenly
    anchors_per_sequence: int = Field(512, ge=1)
    decay_gamma: float | None = 7.0  # w_k = exp(-(k-1)/gamma); None or <= 0: all weights 1
    # labelled positions projected to the vocabulary at once in the loss (blocks.
    # chunked_block_loss): 1,024 x 151,936 float32 logits are 0.6 GB, whatever the row's length
    loss_chunk: int = Field(1024, ge=1)
    # None: the tokenizer's mask token, else the target's last embedding row (vocab_size - 1),
    # which Qwen3's vocabulary pads past its last real token and never emits
    mask_token_id: int | None = Field(None, ge=0)

    # optimisation: AdamW on the drafter; linear warmup over warmup_steps, then a cosine from
    # learning_rate down to 0 at max_steps (so raising max_steps on resume stretches the tail)
    learning_rate: float = Field(6e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    grad_clip: float | None = Field(1.0, gt=0)  # None: no clipping

    # data: the job's rows through the quality gate's rules (`rules()`; a queued run writes its
    # [rules] here, so the gate and this trainer keep the same rows)
    # None: every row whole, the longest the job's cap plus its prompt (docs/TRAINING.md gives
    # the memory a length costs); a longer row is cut to it, or dropped (long_rows)
    max_length: int | None = Field(None, ge=2)
    long_rows: Literal["cut", "drop"] = "cut"  # a longer row: its first max_length tokens, or none
    min_loss_tokens: int = Field(32, ge=0)
    keep_truncated: bool = False
    keep_looping: bool = False  # rows whose output ends in a loop (output/loops.py)
    batch_size: int = Field(1, ge=1)
    shuffle_buffer: int = Field(256, ge=1)

    # length: whichever of max_steps and epochs comes first ends the run
    max_steps: int = Field(1000, ge=1)
    epochs: int | None = Field(None, ge=1)

    # outputs
    checkpoint_every: int = Field(500, ge=1)
    keep_checkpoints: int = Field(3, ge=1)
    log_every: int = Field(10, ge=1)

    seed: int = 0
    device: str = "auto"  # "auto": cuda when available, else cpu
    dtype: Literal["float32", "bfloat16"] = "float32"  # the target's; the drafter trains in float32
    poll_s: float = Field(5.0, gt=0)  # how often a followed job is polled for new batches

    @field_validator("target_layer_ids")
    @classmethod
    def _layer_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and (not ids or min(ids) < 0):
            raise ValueError("must be a non-empty list of layer indices >= 0")
        return ids

    @field_validator("device")
    @classmethod
    def _device(cls, device: str) -> str:
        if device != "auto" and device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"{device!r} is not auto, cpu, cuda or cuda:N")
        return device

    def tokenizer_dir(self) -> str | None:
        """The tokenizer to render rows without server ids: `tokenizer`, else the target
        directory if it holds tokenizer files, else None (such rows are then dropped)."""
        if self.tokenizer is not None:
            return self.tokenizer
        target = Path(self.target_model)
        return self.target_model if any((target / f).is_file() for f in TOKENIZER_FILES) else None

    def rules(self) -> Rules:
        """The rows this trainer reads: the quality gate's rules with these values."""
        return Rules(min_loss_tokens=self.min_loss_tokens, max_length=self.max_length,
                     long_rows=self.long_rows,
                     keep_truncated=self.keep_truncated, keep_looping=self.keep_looping)

    def decay(self) -> float | None:
        """gamma, or None when the decay is off."""
        return self.decay_gamma if self.decay_gamma is not None and self.decay_gamma > 0 else None


def read_table(path: str | Path) -> dict:
    """A .json file's object, or a .toml (any other suffix) file's table; ValueError names the
    file and what is wrong with it."""
    path = Path(path)
    kind = "JSON" if path.suffix == ".json" else "TOML"
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror})") from None
    try:
        data = json.loads(text) if kind == "JSON" else tomllib.loads(text)
    except ValueError as exc:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"{path}: not valid {kind}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a table of fields at the top level")
    return data


def load_config(path: str | Path) -> TrainConfig:
    """A TrainConfig from a .toml or .json file; ValueError names the file and the bad field."""
    data = read_table(path)
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(file)'}: {e['msg']}"
                             for e in exc.errors())
        raise ValueError(f"{path}: {problems}") from None


class SmokeConfig(BaseModel):
    """[smoke]: the overfit gate. The configured drafter trains on the first `rows` rows of the
    job that pass the rules, for `steps` steps, then must reach a mean acceptance length tau of
    `min_tau` replaying those rows (speculation.py); a broken mask or label shift stays near 1."""
    model_config = ConfigDict(extra="forbid")

    rows: int = Field(4, ge=1)
    steps: int = Field(200, ge=1)
    # None: 0.8 of the block size, near the most a block can yield (block_size)
    min_tau: float | None = Field(None, ge=1)
    learning_rate: float | None = Field(None, gt=0)  # None: [reference]'s

    def threshold(self, block_size: int) -> float:
        return self.min_tau if self.min_tau is not None else 0.8 * block_size


class EvalConfig(BaseModel):
    """[eval]: acceptance on held-out prompts (train-eval, and the training worker after every
    checkpoint). The target answers each prompt itself (greedy at temperature 0) under the
    chat template's thinking mode; the drafter's tau is measured along that answer."""
    model_config = ConfigDict(extra="forbid")

    prompts: str                    # a prompt dataset (JSONL or Parquet, as `enqueue` reads)
    max_prompts: int = Field(32, ge=1)
    # z-lab's DFlash benchmark: 2,048 new tokens, greedy (dflash/benchmark.py)
    max_new_tokens: int = Field(2048, ge=2)
    temperature: float = Field(0.0, ge=0)
    enable_thinking: bool | None = None  # None: the mode of the run's rows
    seed: int = 0
    every_checkpoint: bool = True   # the training worker evaluates each checkpoint it writes
