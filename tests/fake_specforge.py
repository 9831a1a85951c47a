"""Stands in for SpecForge 0.2.0's `specforge` CLI in the queue tests: its trainer needs GPUs, a
patched SGLang capture server and Mooncake. Everything up to there is SpecForge's own code: the
command line as specforge.cli parses it, the config through specforge.config.load_config, the
data through specforge.data.prompt_builder.prepare_prompt_tasks (the loader its trainer uses,
with the tokenizer at model.target_model_path). It writes what it read to ./seen.json and a
checkpoint laid out as SpecForge's CheckpointManager does (<run_id>-step5/, <run_id>-latest).

    fake_specforge.py train --config FILE
"""
from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

parser = argparse.ArgumentParser(prog="specforge")
sub = parser.add_subparsers(dest="command", required=True)
train = sub.add_parser("train")
train.add_argument("-c", "--config", required=True)
train.add_argument("overrides", nargs="*")
args = parser.parse_args()

from specforge.config import load_config  # noqa: E402
from specforge.data.prompt_builder import prepare_prompt_tasks  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

cfg = load_config(args.config, args.overrides)
path = cfg.data.prompts_path or cfg.data.train_data_path
tokenizer = AutoTokenizer.from_pretrained(cfg.model.target_model_path, local_files_only=True)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    tasks = prepare_prompt_tasks(path, tokenizer, chat_template=cfg.data.chat_template,
                                 max_length=cfg.data.max_length, is_preformatted=False,
                                 train_only_last_turn=cfg.data.train_only_last_turn,
                                 cache_dir=None, cache_key=None, num_proc=None, min_loss_tokens=2)
samples = [t["payload"] for t in tasks]
Path("seen.json").write_text(json.dumps(samples))
print(f"specforge: {len(samples)} samples from {Path(path).name} "
      f"({'pre-tokenized' if cfg.data.prompts_path else cfg.data.chat_template})", flush=True)
ckpt = Path(cfg.output_dir) / f"{cfg.run_id}-step5"
ckpt.mkdir(parents=True)
(ckpt / "training_state.pt").write_bytes(os.urandom(512))
os.symlink(ckpt.name, Path(cfg.output_dir) / f"{cfg.run_id}-latest")
print(f"saved checkpoint {ckpt}", flush=True)
