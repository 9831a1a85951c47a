"""Length and truncation statistics of a job: "what is the max completion length, are we hitting
the cap often?" answered in seconds.

Two sources. The ledger's counters cover every row at O(1) cost: finish reasons and a histogram
of output lengths in 64-token buckets (complete.lua), so the percentiles of a million rows cost
one HGETALL. What counters cannot say (reasoning against answer length, empty answers, think
markers leaking into `content`, where truncation struck, prompt lengths) comes from a sample of
the newest rows: those still in the Redis stream, then the newest sealed batches.
"""
from __future__ import annotations

from itertools import islice
from typing import Iterable

import redis

from dflash_tasks.core.keys import GpuName, JobName
from dflash_tasks.ingest.prompts import prompt_of
from dflash_tasks.ledger import HIST_BUCKET_TOKENS, truncated_split
from dflash_tasks.ledger.histogram import bucket_value, length_percentile, rank
from dflash_tasks.output.batches import iter_newest_rows
from dflash_tasks.output.storage import Storage

THINK_MARKERS = ("<think>", "</think>")


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (q in 0..100) of an ascending list, by the project's one rank rule,
    nearest rank (ledger.histogram.rank); 0 for an empty list."""
    if not sorted_values:
        return 0
    return sorted_values[rank(q / 100, len(sorted_values)) - 1]


def summary(values: Iterable[float]) -> dict:
    v = sorted(values)
    if not v:
        return {"count": 0, "mean": 0, "p50": 0, "p90": 0, "p99": 0, "max": 0}
    return {"count": len(v), "mean": round(sum(v) / len(v), 1), "p50": percentile(v, 50),
            "p90": percentile(v, 90), "p99": percentile(v, 99), "max": v[-1]}


def histogram_percentiles(hist: dict[int, int], max_tokens: int | None) -> dict:
    """Percentiles from the ledger's length histogram, capped at max_tokens
    (ledger.histogram.length_percentile: a bucket's lower edge, or the cap for the bucket holding
    the cap, since truncated rows are exactly the cap)."""
    total = sum(hist.values())
    if not total:
        return {"count": 0, "p50": 0, "p90": 0, "p99": 0, "max": 0}
    return {"count": total,
            **{f"p{q}": length_percentile(hist, q / 100, max_tokens) for q in (50, 90, 99)},
            # the highest bucket that still holds a row (a regenerate empties the ones it left)
            "max": bucket_value(max(b for b, n in hist.items() if n > 0), max_tokens)}


def sample_rows(r: redis.Redis, storage: Storage, job: JobName, n: int) -> list[dict]:
    """Up to n of the newest rows, one per id (a regenerated prompt counts by its new row)."""
    return list(islice(iter_newest_rows(r, storage, job), n))


def row_facts(row: dict) -> dict:
    meta = row["metadata"]
    answer = row["conversations"][-1]
    content = answer.get("content") or ""
    reasoning = answer.get("reasoning_content") or ""
    reasoning_tokens = int(meta.get("reasoning_tokens") or 0)
    return {
        "gpu": meta.get("gpu"),
        "finish_reason": meta["finish_reason"],
        "prompt_tokens": meta["prompt_tokens"],
        "output_tokens": meta["completion_tokens"],
        "reasoning_tokens": reasoning_tokens,
        "answer_tokens": max(0, meta["completion_tokens"] - reasoning_tokens),
        "empty_answer": not content.strip(),
        "empty_reasoning": bool(meta.get("enable_thinking")) and not reasoning.strip(),
        "think_marker_in_content": any(m in content for m in THINK_MARKERS),
        # Cut by the cap before the answer began: the reasoning never finished.
        "truncated_thinking": meta["finish_reason"] == "length" and not content.strip(),
        "loop_period": (meta.get("loop") or {}).get("period"),  # ends in a loop (loops.py)
    }



def _pct(part: int, whole: int) -> float:
    return round(100 * part / whole, 2) if whole else 0.0


def repeated_samples(rows: list[dict], samples: int) -> int:
    """Rows whose output (reasoning and answer) another row of the same prompt also has: samples
    that did not sample (a temperature of 0, a seed shared), 0 when every sample differs."""
    seen: set[tuple[str, str, str]] = set()
    repeated = 0
    for row in rows:
        answer = row["conversations"][-1]
        key = (prompt_of(row["id"], samples), answer.get("reasoning_content") or "",
               answer.get("content") or "")
        repeated += key in seen
        seen.add(key)
    return repeated


def job_stats(r: redis.Redis, storage: Storage, job: JobName, *, max_tokens: int | None,
              sample: int = 2000, samples: int = 1, turns: str = "last") -> dict:
    raw = {k.decode(): int(v) for k, v in r.hgetall(job.counters).items()}
    completed = raw.get("completed", 0)
    prompts = raw.get("total", 0) // samples
    finish = {k.split(":", 1)[1]: v for k, v in raw.items() if k.startswith("finish:")}
    hist = {int(k.split(":", 1)[1]): v for k, v in raw.items() if k.startswith("hist:")}
    gpus = GpuName.among(k.split(":")[1] for k in raw if k.startswith("gpu:"))

    rows = sample_rows(r, storage, job, sample) if sample else []
    facts = [row_facts(row) for row in rows]
    truncated = [f for f in facts if f["finish_reason"] == "length"]
    return {
        "job": job,
        "completed": completed,
        "max_tokens": max_tokens,
        "output_tokens": histogram_percentiles(hist, max_tokens),
        "finish_reasons": finish,
        "truncated_pct": _pct(finish.get("length", 0), completed),
        "truncated": truncated_split(raw),
        # enqueue --samples: rows a prompt gives, and how many it has so far on average
        "rows_per_prompt": {"samples": samples, "prompts": prompts,
                            "mean": round(completed / prompts, 2) if prompts else 0.0},
        # enqueue --turns all: a row is a conversation; a reply cut at the cap ends it (its
        # row's finish_reason is its last reply's), and its later turns are never generated.
        "turns": {"conversations": completed, "replies": raw.get("turns", 0) + completed,
                  "mean_replies": round((raw.get("turns", 0) + completed) / completed, 2)
                  if completed else 0.0,
                  "ended_by_length": finish.get("length", 0)} if turns == "all" else None,
        "per_gpu": {g: {"completed": raw.get(f"gpu:{g}:completed", 0),
                                "output_tokens": raw.get(f"gpu:{g}:output_tokens", 0)} for g in gpus},
        "sample": {
            "rows": len(facts),
            "output_tokens": summary(f["output_tokens"] for f in facts),
            "reasoning_tokens": summary(f["reasoning_tokens"] for f in facts),
            "answer_tokens": summary(f["answer_tokens"] for f in facts),
            "prompt_tokens": summary(f["prompt_tokens"] for f in facts),
            "truncated_pct": _pct(len(truncated), len(facts)),
            "truncated_thinking_pct": _pct(sum(f["truncated_thinking"] for f in truncated), len(facts)),
            "truncated_answer_pct": _pct(sum(not f["truncated_thinking"] for f in truncated), len(facts)),
            # the truncated rows of the sample, looping or progressing, with their lengths
            "truncated_looping": summary(f["output_tokens"] for f in truncated if f["loop_period"]),
            "truncated_progressing": summary(f["output_tokens"] for f in truncated
                                             if not f["loop_period"]),
            "loop_periods": summary(f["loop_period"] for f in truncated if f["loop_period"]),
            "empty_answers": sum(f["empty_answer"] for f in facts),
            "empty_reasoning": sum(f["empty_reasoning"] for f in facts),
            "think_markers_in_content": sum(f["think_marker_in_content"] for f in facts),
            "repeated_samples": repeated_samples(rows, samples) if samples > 1 else 0,
            "per_gpu": {str(g): summary(f["output_tokens"] for f in facts if f["gpu"] == g)
                        for g in GpuName.among(f["gpu"] for f in facts if f["gpu"])},
        },
    }


def plot_lengths(hist: dict[int, int], max_tokens: int | None, path: str) -> None:
    """A PNG histogram of output lengths with the cap marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    buckets = sorted(hist)
    ax.bar(buckets, [hist[b] for b in buckets], width=HIST_BUCKET_TOKENS, align="edge", color="#4C72B0")
    if max_tokens:
        ax.axvline(max_tokens, color="#C44E52", linestyle="--", linewidth=2,
                   label=f"max_tokens = {max_tokens:,}")
        ax.legend()
    ax.set_xlabel("output tokens")
    ax.set_ylabel("completions")
    ax.set_title("Output length distribution")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def counter_hist(r: redis.Redis, job: JobName) -> dict[int, int]:
    raw = r.hgetall(job.counters)
    return {int(k.decode().split(":", 1)[1]): int(v) for k, v in raw.items() if k.startswith(b"hist:")}

