"""The reference trainer outside the training queue, on one process or, under torchrun, on
several (distributed.py):

    python -m dflash_tasks.training.reference --config reference.toml --job J --source DIR_OR_S3 \
        --run-dir DIR
    torchrun --nproc_per_node 8 -m dflash_tasks.training.reference --config ... (the same)

--config is a TrainConfig file (the [reference] fields, at its top level). A run directory that
holds a checkpoint is resumed from the newest, with the process count that wrote it."""
from __future__ import annotations

import argparse
import json
import sys

from dflash_tasks.training.reference.config import load_config
from dflash_tasks.training.reference.distributed import join
from dflash_tasks.training.reference.trainer import train


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_tasks.training.reference",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="a TrainConfig .toml or .json")
    ap.add_argument("--job", required=True, help="the job whose rows to train on")
    ap.add_argument("--source", required=True, help="its batches: a directory or an s3:// URI")
    ap.add_argument("--run-dir", required=True, help="metrics.jsonl and checkpoints/ go here")
    args = ap.parse_args(argv)
    try:
        config = load_config(args.config)
    except ValueError as exc:
        ap.error(str(exc))
    ranks = join()
    try:  # the trainer's lines are rank 0's alone
        result = train(config, job=args.job, source=args.source, run_dir=args.run_dir,
                       log=lambda line: print(line, flush=True))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if ranks.main:
        print(json.dumps({"status": result.status, "step": result.step,
                          "checkpoints": [str(p) for p in result.checkpoints]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
