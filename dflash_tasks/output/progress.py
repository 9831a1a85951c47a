"""The run's state in figures, from counters only, so it costs the same at 1,000,000 prompts as
at 1,000: one HGETALL of the job's counters (bounded: totals, finish reasons, histograms, per
GPU), one HMGET of the rate buckets in the window, and a few O(1) reads. progress.json,
`manage.py status` and the demo all print this one dictionary; docs/PROGRESS_AND_S3.md
documents every field.

Where SGLang's `bench_serving` has a name for a figure, the figure carries that name too
(request_throughput, input_throughput, output_throughput, *_e2e_latency_ms), so a run can be set
beside a benchmark of the same server.
"""
from __future__ import annotations

import json
import time

import redis

from dflash_tasks import dispatch
from dflash_tasks.core import jobs
from dflash_tasks.core.keys import BEAT_SEEN, SERVERS, WORKERS, WORKERS_SEEN, JobKeys
from dflash_tasks.core.settings import Settings
from dflash_tasks.ledger import HIST_BUCKET_TOKENS
from dflash_tasks.output.batches import latency_bucket_ms

RATE_BUCKET_S = 10  # the ledger's completion buckets (complete.lua)
ALIVE_PERIODS = 3   # a GPU worker is alive while its heartbeat is under this many periods old


def _int(raw: dict, key: str) -> int:
    return int(raw.get(key, 0))


def _percentile(hist: dict[int, int], q: float) -> int | None:
    """The bucket holding the q-quantile of a histogram {bucket: count}."""
    n = sum(hist.values())
    if not n:
        return None
    rank, seen = q * n, 0
    for bucket in sorted(hist):
        seen += hist[bucket]
        if seen >= rank:
            return bucket
    return max(hist)


def _hist(c: dict[str, int], prefix: str) -> dict[int, int]:
    return {int(key[len(prefix):]): v for key, v in c.items() if key.startswith(prefix) and v > 0}


def rate_fields(bucket: int, gpus: int) -> list[str]:
    """Every field complete.lua writes into the rate hash for one bucket."""
    return [f"c:{bucket}", f"t:{bucket}", f"i:{bucket}",
            *(f"g{gpu}:{kind}:{bucket}" for gpu in range(gpus) for kind in ("c", "t"))]


def snapshot(r: redis.Redis, name: str, s: Settings) -> dict:
    job = jobs.load(r, name)
    if job is None:
        raise KeyError(f"no job named {name!r}")
    k = job.keys
    seconds, micros = r.time()
    now = seconds + micros / 1e6
    window_start = now - s.rate_window_s
    buckets = list(range(int(window_start - window_start % RATE_BUCKET_S), int(now) + 1, RATE_BUCKET_S))
    nb = len(buckets)
    rate_keys = ([f"c:{b}" for b in buckets] + [f"t:{b}" for b in buckets] + [f"i:{b}" for b in buckets]
                 + [f"g{gpu}:{kind}:{b}" for gpu in range(job.gpus) for kind in ("c", "t") for b in buckets])

    # Retries waiting for their ETA are in flight too; which of them still are is read in the
    # same transaction as every count, so pending + in flight + waiting + completed + failed
    # equals the total at that instant (each ledger script is atomic).
    waiting_candidates = dispatch.waiting_retries(r, name)
    pipe = r.pipeline(transaction=True)
    pipe.hgetall(k.counters)
    pipe.llen(k.pending)
    pipe.xlen(k.output)
    pipe.hmget(k.rate, rate_keys)
    pipe.hgetall(WORKERS)
    pipe.get(k.sealing)
    pipe.hgetall(k.storage_error)
    pipe.hgetall(WORKERS_SEEN)
    pipe.hgetall(SERVERS)
    pipe.get(BEAT_SEEN)
    for gpu in range(job.gpus):
        pipe.zcard(k.inflight(gpu))
    retrying_gpus = [g for g in range(job.gpus) if waiting_candidates.get(g)]
    for gpu in retrying_gpus:
        pipe.zmscore(k.inflight(gpu), waiting_candidates[gpu])
    (counters_raw, pending, unsealed, rate_raw, workers_raw, sealing, storage_error, seen_raw,
     servers_raw, beat_seen, *rest) = pipe.execute()
    waiting = [0] * job.gpus
    for gpu, scores in zip(retrying_gpus, rest[job.gpus:]):
        waiting[gpu] = len({i for i, score in zip(waiting_candidates[gpu], scores) if score is not None})
    inflight = [n - w for n, w in zip(rest[:job.gpus], waiting)]  # sent, or queued to be sent
    servers = {key.decode(): json.loads(v) for key, v in servers_raw.items()}
    seen = {key.decode(): float(v) for key, v in seen_raw.items()}

    c = {key.decode(): int(v) for key, v in counters_raw.items()}
    total, completed, failed = _int(c, "total"), _int(c, "completed"), _int(c, "failed")
    in_tokens, out_tokens = _int(c, "input_tokens"), _int(c, "output_tokens")
    rv = [int(v or 0) for v in rate_raw]

    def window_sum(i: int) -> int:  # the i-th run of nb bucket values in rate_keys
        return sum(rv[i * nb:(i + 1) * nb])

    first_done = c.get("first_completed_at")
    span = now - max(buckets[0], first_done - first_done % RATE_BUCKET_S) if first_done else 0.0

    def per_s(count: int) -> float:
        return count / span if span > 0 else 0.0

    rate = per_s(window_sum(0))
    out_rate, in_rate = per_s(window_sum(1)), per_s(window_sum(2))
    remaining = max(0, total - completed - failed)
    finish_reasons = {key.split(":", 1)[1]: v for key, v in c.items() if key.startswith("finish:")}
    workers = {key.decode(): json.loads(v) for key, v in workers_raw.items()}

    out_hist = _hist(c, "hist:")
    lat_hist = _hist(c, "lat:")
    lat_n = _int(c, "latency_n")

    def lat_pct(q: float) -> float | None:
        b = _percentile(lat_hist, q)
        return round(latency_bucket_ms(b), 1) if b is not None else None

    def out_pct(q: float) -> int | None:
        b = _percentile(out_hist, q)
        # As `manage.py stats` reports them: a bucket's lower edge, or the cap for the bucket
        # holding the cap (truncated outputs are exactly the cap).
        if b is None:
            return None
        cap = job.params.max_tokens
        return cap if b <= cap < b + HIST_BUCKET_TOKENS else b

    err = {key.decode(): v.decode() for key, v in storage_error.items()}
    gpus = {}
    for gpu in range(job.gpus):
        base = 3 + 2 * gpu
        g_rate, g_tokens = per_s(window_sum(base)), per_s(window_sum(base + 1))
        beat = seen.get(f"gpu{gpu}")
        age = round(now - beat, 1) if beat is not None else None
        gpus[f"gpu{gpu}"] = {
            "completed": _int(c, f"gpu:{gpu}:completed"),
            "output_tokens": _int(c, f"gpu:{gpu}:output_tokens"),
            "request_throughput": round(g_rate, 3),
            "output_tokens_per_sec": round(g_tokens, 1),
            "output_throughput": round(g_tokens, 1),
            "in_flight": inflight[gpu],
            "retry_waiting": waiting[gpu],
            "retries": _int(c, f"gpu:{gpu}:retries"),
            "worker": workers.get(f"gpu{gpu}", {}).get("hostname"),
            "alive": age is not None and age < ALIVE_PERIODS * s.worker_heartbeat_s,
            "heartbeat_age_s": age,
            # The server's own view (its /metrics, sampled by the worker): running requests
            # below its decode slots while prompts are pending means the slots are not full.
            "server": _server_view(servers.get(f"gpu{gpu}"), now),
        }

    return {
        "job": name,
        "status": job.status,
        "total": total,
        "completed": completed,
        "failed": failed,
        "pending": pending,
        "in_flight": sum(inflight),
        "retry_waiting": sum(waiting),
        "remaining": remaining,
        "retries": _int(c, "retries"),
        "retry_reasons": {key.split(":", 1)[1]: v for key, v in c.items() if key.startswith("retry:")},
        "rate_per_sec": round(rate, 3),
        "request_throughput": round(rate, 3),
        "output_tokens_per_sec": round(out_rate, 1),
        "output_throughput": round(out_rate, 1),
        "input_throughput": round(in_rate, 1),
        "rate_window_s": s.rate_window_s,
        "eta_hours": round(remaining / rate / 3600, 3) if rate > 0 else None,
        "elapsed_hours": round((now - job.created_at) / 3600, 4),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "avg_input_tokens": round(in_tokens / completed, 1) if completed else 0.0,
        "avg_output_tokens": round(out_tokens / completed, 1) if completed else 0.0,
        "median_output_tokens": out_pct(0.5),
        "p90_output_tokens": out_pct(0.9),
        "short_output_pct": round(100 * out_hist.get(0, 0) / completed, 2) if completed else 0.0,
        "finish_reasons": finish_reasons,
        "truncated_pct": round(100 * finish_reasons.get("length", 0) / completed, 2) if completed else 0.0,
        "mean_e2e_latency_ms": round(_int(c, "latency_ms_sum") / lat_n, 1) if lat_n else None,
        "median_e2e_latency_ms": lat_pct(0.5),
        "p90_e2e_latency_ms": lat_pct(0.9),
        "p99_e2e_latency_ms": lat_pct(0.99),
        "latency_rows": lat_n,
        "batches": _int(c, "batches"),
        "batch_bytes": _int(c, "batch_bytes"),
        "s3_uploaded": _int(c, "s3_uploaded"),
        "s3_bytes": _int(c, "s3_bytes"),
        "s3_uri": s.s3_uri,
        "unsealed_rows": unsealed,
        "sealing_batch": json.loads(sealing)["name"] if sealing else None,
        "storage_error": ({"error": err.get("error"), "since": float(err.get("since", 0)),
                           "failures": int(err.get("failures", 0))} if err else None),
        "params": {"max_tokens": job.params.max_tokens, "temperature": job.params.temperature,
                   "top_p": job.params.top_p, "top_k": job.params.top_k,
                   "enable_thinking": job.params.enable_thinking},
        "gpus": gpus,
        # Seconds since beat's last tick (None: never). Without beat nothing is sealed, shipped
        # or marked done: `status` says so.
        "beat_age_s": round(now - float(beat_seen), 1) if beat_seen else None,
        "quality": _quality(r, name),
        "updated_at": round(time.time(), 3),
    }


def _server_view(sample: dict | None, now: float) -> dict | None:
    if sample is None:
        return None
    view = {k: sample.get(k) for k in ("running", "queued", "gen_throughput", "token_usage",
                                       "cache_hit_rate", "error")}
    view["age_s"] = round(now - sample["at"], 1)
    return view


def is_finished(snap: dict) -> bool:
    """Every prompt has an outcome and every row is sealed into a batch."""
    return (snap["total"] > 0 and snap["completed"] + snap["failed"] >= snap["total"]
            and snap["pending"] == 0 and snap["unsealed_rows"] == 0
            and snap.get("sealing_batch") is None)


def prune_rate(r: redis.Redis, name: str, gpus: int, keep_s: float) -> int:
    """Delete the rate buckets older than keep_s, so the rate hash stays small in a run of
    days. Walks only the buckets since the last prune (idempotent: two beats may both run it)."""
    k = JobKeys(name)
    seconds, _ = r.time()
    cutoff = int(seconds - keep_s)
    cutoff -= cutoff % RATE_BUCKET_S
    start = r.hget(k.rate, "pruned_before") or r.hget(k.counters, "first_completed_at")
    if start is None:
        return 0
    start = int(start) - int(start) % RATE_BUCKET_S
    deleted = 0
    fields: list[str] = []
    for bucket in range(start, cutoff, RATE_BUCKET_S):
        fields.extend(rate_fields(bucket, gpus))
        if len(fields) >= 2000:
            deleted += r.hdel(k.rate, *fields)
            fields = []
    if fields:
        deleted += r.hdel(k.rate, *fields)
    if cutoff > start:
        r.hset(k.rate, "pruned_before", cutoff)
    return deleted


def _quality(r: redis.Redis, job: str) -> dict | None:
    """The training-data figures beat's quality monitor (training/data/monitor.py, the key's
    writer) stored at its last tick; None before its first sample. One GET."""
    raw = r.get(JobKeys(job).quality("figures"))
    return json.loads(raw) if raw else None
