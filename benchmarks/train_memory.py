"""Case 19: the peak memory of one reference training step on an 8,192-token row (512 anchors of
a 16-token block), with the loss over the vocabulary at once and in chunks (blocks.
chunked_block_loss). Each measure runs in a process of its own: a tiny Qwen3 target (hidden 64,
4 layers) of vocabulary V, a 1-layer drafter, the trainer's own step (trainer._Run.step) on one row of 200 prompt
and 7,992 response tokens, and the process's peak resident memory less its memory before the
step. Measured at two vocabularies and scaled linearly to Qwen3's 151,936 (what grows with the
vocabulary is the logits, their softmax and gradient): a and b of peak = a + b x V.

    python -m benchmarks.train_memory --vocab 16384 --chunk 0     (0: every position at once)
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QWEN3_VOCAB = 151_936
ROW, PROMPT, ANCHORS, BLOCK = 8192, 200, 512, 16
VOCABS = (16_384, 32_768)
CHUNK = 1024


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def one_step(vocab: int, chunk: int) -> dict:
    """In this process: the target built, one step trained, the peak over the step."""
    import torch
    import transformers

    from dflash_tasks.training.reference.config import TrainConfig
    from dflash_tasks.training.reference.trainer import Window, _Run

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        config = transformers.Qwen3Config(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=ROW, tie_word_embeddings=False)
        torch.manual_seed(0)
        transformers.Qwen3ForCausalLM(config).save_pretrained(tmp)
        # one drafter layer: what the vocabulary costs is the loss's, at any depth
        run = _Run(TrainConfig(target_model=tmp, block_size=BLOCK, anchors_per_sequence=ANCHORS,
                               drafter_layers=1, loss_chunk=chunk or ANCHORS * BLOCK,
                               device="cpu"),
                   Path(tmp) / "run", lambda line: None, None)
        run.window = Window(BLOCK)
        run.started, run.elapsed_before = 0.0, 0.0
        ids = torch.randint(0, vocab - 1, (ROW,))
        sample = {"id": "long", "input_ids": ids,
                  "loss_mask": torch.cat([torch.zeros(PROMPT), torch.ones(ROW - PROMPT)]).long(),
                  "attention_mask": torch.ones(ROW, dtype=torch.long)}
        before = _rss_bytes()
        run.step([sample])
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"vocab": vocab, "chunk": chunk, "step_peak_bytes": max(0, peak - before)}


def memory_case() -> dict:
    """Case 19, each measure in a process of its own."""
    from benchmarks.bench import log

    measured = []
    for chunk in (0, CHUNK):
        for vocab in VOCABS:
            log(f"case 19: one training step on an {ROW:,}-token row, vocabulary {vocab:,}, "
                + ("the loss at once" if not chunk else f"the loss in chunks of {chunk:,}"))
            out = subprocess.run([sys.executable, "-m", "benchmarks.train_memory", "--vocab",
                                  str(vocab), "--chunk", str(chunk)], cwd=ROOT, check=True,
                                 capture_output=True, text=True, timeout=1800).stdout
            measured.append(json.loads(out.strip().splitlines()[-1]))
    scaled = {}
    for chunk in (0, CHUNK):
        (v1, p1), (v2, p2) = [(m["vocab"], m["step_peak_bytes"]) for m in measured
                              if m["chunk"] == chunk]
        per_token = (p2 - p1) / (v2 - v1)
        scaled[chunk] = {"fixed_bytes": p1 - per_token * v1, "per_vocab_bytes": per_token,
                         "qwen3_bytes": p1 + per_token * (QWEN3_VOCAB - v1)}
    return {"row": ROW, "anchors": ANCHORS, "block": BLOCK, "chunk": CHUNK,
            "measured": measured, "scaled": {str(k): v for k, v in scaled.items()}}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--chunk", type=int, required=True)
    args = ap.parse_args()
    print(json.dumps(one_step(args.vocab, args.chunk)))
