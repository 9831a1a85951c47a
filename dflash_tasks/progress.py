"""The run's state in figures, from counters only, so it costs the same at 1,000,000 prompts as
at 1,000. progress.json, `manage.py status` and the demo all print this one dictionary."""
from __future__ import annotations

import json
import time

import redis

from . import jobs
from .keys import WORKERS, JobKeys
from .settings import Settings

RATE_BUCKET_S = 10  # the ledger's completion buckets (complete.lua)


def _int(raw: dict, key: str) -> int:
    return int(raw.get(key, 0))


def snapshot(r: redis.Redis, name: str, s: Settings) -> dict:
    job = jobs.load(r, name)
    if job is None:
        raise KeyError(f"no job named {name!r}")
    k = job.keys
    now = float(r.time()[0])
    window_start = now - s.rate_window_s
    buckets = list(range(int(window_start - window_start % RATE_BUCKET_S), int(now) + 1, RATE_BUCKET_S))

    pipe = r.pipeline(transaction=False)
    pipe.hgetall(k.counters)
    pipe.llen(k.pending)
    pipe.xlen(k.output)
    pipe.hmget(k.rate, [f"c:{b}" for b in buckets] + [f"t:{b}" for b in buckets])
    pipe.hgetall(WORKERS)
    for gpu in range(job.gpus):
        pipe.zcard(k.inflight(gpu))
    counters_raw, pending, unsealed, rate_raw, workers_raw, *inflight = pipe.execute()

    c = {key.decode(): int(v) for key, v in counters_raw.items()}
    total, completed, failed = _int(c, "total"), _int(c, "completed"), _int(c, "failed")
    out_tokens = _int(c, "output_tokens")
    rate_values = [int(v or 0) for v in rate_raw]
    recent_done, recent_tokens = sum(rate_values[:len(buckets)]), sum(rate_values[len(buckets):])
    first_done = c.get("first_completed_at")
    span = now - max(buckets[0], first_done - first_done % RATE_BUCKET_S) if first_done else 0
    rate = recent_done / span if span > 0 else 0.0
    tokens_rate = recent_tokens / span if span > 0 else 0.0
    remaining = max(0, total - completed - failed)
    finish_reasons = {key.split(":", 1)[1]: v for key, v in c.items() if key.startswith("finish:")}
    workers = {key.decode(): json.loads(v) for key, v in workers_raw.items()}

    return {
        "job": name,
        "status": job.status,
        "total": total,
        "completed": completed,
        "failed": failed,
        "pending": pending,
        "in_flight": sum(inflight),
        "remaining": remaining,
        "rate_per_sec": round(rate, 3),
        "request_throughput": round(rate, 3),
        "output_tokens_per_sec": round(tokens_rate, 1),
        "output_throughput": round(tokens_rate, 1),
        "eta_hours": round(remaining / rate / 3600, 3) if rate > 0 else None,
        "elapsed_hours": round((now - job.created_at) / 3600, 4),
        "total_input_tokens": _int(c, "input_tokens"),
        "total_output_tokens": out_tokens,
        "avg_output_tokens": round(out_tokens / completed, 1) if completed else 0.0,
        "finish_reasons": finish_reasons,
        "truncated_pct": round(100 * finish_reasons.get("length", 0) / completed, 2) if completed else 0.0,
        "batches": _int(c, "batches"),
        "batch_bytes": _int(c, "batch_bytes"),
        "s3_uploaded": _int(c, "batches") if s.s3_uri else 0,
        "s3_bytes": _int(c, "batch_bytes") if s.s3_uri else 0,
        "unsealed_rows": unsealed,
        "params": {"max_tokens": job.params.max_tokens, "temperature": job.params.temperature,
                   "top_p": job.params.top_p, "top_k": job.params.top_k,
                   "enable_thinking": job.params.enable_thinking},
        "gpus": {
            f"gpu{gpu}": {
                "completed": _int(c, f"gpu:{gpu}:completed"),
                "output_tokens": _int(c, f"gpu:{gpu}:output_tokens"),
                "in_flight": inflight[gpu],
                "worker": workers.get(f"gpu{gpu}", {}).get("hostname"),
            } for gpu in range(job.gpus)
        },
        "updated_at": round(time.time(), 3),
    }


def is_finished(snap: dict) -> bool:
    """Every prompt has an outcome and every row is sealed into a batch."""
    return (snap["total"] > 0 and snap["completed"] + snap["failed"] >= snap["total"]
            and snap["pending"] == 0 and snap["unsealed_rows"] == 0)
