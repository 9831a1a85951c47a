"""A stand-in for an external trainer (SpecForge's CLI), run by the command trainer in the tests.

    python tests/command_trainer.py ok   --data PATH --out DIR  # reads the export, writes a checkpoint
    python tests/command_trainer.py fail --data PATH --out DIR  # exits 3 with an error
    python tests/command_trainer.py hang --data PATH --out DIR  # writes its pid, waits for a signal
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=["ok", "fail", "hang"])
parser.add_argument("--data", type=Path, required=True)
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()

rows = [json.loads(line) for line in args.data.read_text().splitlines() if line]
print(f"read {len(rows)} rows from {args.data.name}", flush=True)
if args.mode == "ok":
    ckpt = args.out / "step_5"
    ckpt.mkdir(parents=True)
    (ckpt / "weights.bin").write_bytes(os.urandom(2048))
    (ckpt / "config.json").write_text(json.dumps({"rows": len(rows)}))
    print(f"saved checkpoint {ckpt}", flush=True)
elif args.mode == "fail":
    print("error: CUDA out of memory (pretend)", file=sys.stderr, flush=True)
    sys.exit(3)
else:
    # Written whole or not at all (a rename): the test reads it as soon as it exists.
    (args.out / "trainer.pid.tmp").write_text(str(os.getpid()))
    os.replace(args.out / "trainer.pid.tmp", args.out / "trainer.pid")
    print("training started; waiting", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM, saving and exiting", flush=True),
                                              sys.exit(143)))
    while True:
        signal.pause()
