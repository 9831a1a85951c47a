"""The run's state in figures, from counters only, so it costs the same at 1,000,000 prompts as
at 1,000. progress.json, `manage.py status` and the demo all print this one dictionary;
docs/PROGRESS_AND_S3.md documents every field.

A snapshot is made in three steps:

- `read`: the job, Redis's clock, then ONE transaction (MULTI) whose results come back by name
  into `Reads`: the job's counters (bounded: totals, finish reasons, histograms, per GPU), one
  HMGET of the rate buckets in the window, per GPU its in-flight count and its retries waiting
  (counted inside Redis), and a few O(1) reads. The same commands at any size of job, and
  whatever the broker holds: nothing reads kombu's `unacked` hash (tests/test_progress.py).
- compute: pure functions of `Reads` (rates over the window, percentiles, per-GPU views).
- `render`: the dictionary, in its documented order.

Where SGLang's `bench_serving` has a name for a figure, the figure carries that name
(request_throughput, input_throughput, output_throughput, *_e2e_latency_ms), so a run can be set
beside a benchmark of the same server; ALIASES says which figures carry two names, and why.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import redis

from dflash_tasks import dispatch
from dflash_tasks.core import jobs
from dflash_tasks.core.keys import (
    BEAT_SEEN,
    BREAKERS,
    MEMORY_HOLD,
    SERVERS,
    WORKERS,
    WORKERS_SEEN,
    GpuName,
    JobName,
)
from dflash_tasks.core.scripts import Script
from dflash_tasks.core.settings import Settings
from dflash_tasks.ledger import truncated_split
from dflash_tasks.ledger.histogram import length_percentile, nearest_rank
from dflash_tasks.output import eta
from dflash_tasks.output.batches import latency_bucket_ms
from dflash_tasks.output.storage import Storage, StorageNotFound

RATE_BUCKET_S = 10  # the ledger's completion buckets (complete.lua)
# The prompts in flight on a GPU read one by one for the token ETA; more are read in as many
# strata of age (in_flight_ages.lua), so the snapshot costs the same at any depth.
IN_FLIGHT_STRATA = 16
IN_FLIGHT_AGES = Script(__file__, "in_flight_ages")
GOING_ON_COUNTS = Script(__file__, "going_on_counts")
RATE_WINDOW = Script(__file__, "rate_window")
ALIVE_PERIODS = 3   # a GPU worker is alive while its heartbeat is under this many periods old

# The only figures written under two names, each pair in one place: the first name is the
# seed's progress.json field (readers of progress.json were promised it), the second is SGLang
# bench_serving's name for the same figure. `render` writes the first; `_aliased` adds the second
# right after it, with the same value. Every other field is one figure under one name (a GPU's
# view has no seed name for its rate: there request_throughput is the only name).
ALIASES = {
    "rate_per_sec": "request_throughput",
    "output_tokens_per_sec": "output_throughput",
}


# -- read ----------------------------------------------------------------------------------------

def rate_series(gpus: list[GpuName]) -> list[str]:
    """The series complete.lua counts in the rate hash, each as "<series>:<bucket>": the job's
    completions ("c"), output tokens ("t") and input tokens ("i"), and per GPU its completions
    and output tokens ("<gpu>:c", "<gpu>:t"); and next_round.lua a conversation's replies
    handed on to their next turn ("r")."""
    return ["c", "t", "i", "r", *(f"{gpu}:{kind}" for gpu in gpus for kind in ("c", "t"))]


def rate_fields(bucket: int, gpus: list[GpuName]) -> list[str]:
    """Every field complete.lua writes into the rate hash for one bucket."""
    return [f"{series}:{bucket}" for series in rate_series(gpus)]


@dataclass(frozen=True, slots=True)
class Reads:
    """Everything one snapshot reads, decoded, by name."""
    job: jobs.Job
    gpus: list[GpuName]                  # the job's GPUs (dispatch.job_gpus), by node and index
    now: float                       # Redis's clock, in seconds
    window_start: int                # the first rate bucket of the window
    window: dict[str, int]           # rate series (rate_series) -> its sum over the window
    counters: dict[str, int]         # the job's counters hash
    pending: int                     # prompts not yet dispatched
    unsealed_rows: int               # rows in the output stream, not yet sealed into a batch
    in_flight_set: dict[str, int]    # GPU -> its in-flight set's size, retries waiting included
    sent_at: dict[str, list[tuple[float, int, int]]]  # GPU -> (the Redis second prompts in
    # flight were sent, the output tokens their generation held then: a round's or a move's,
    # going_on; how many), oldest first (in_flight_ages.lua: past IN_FLIGHT_STRATA, strata)
    paused: dict[int, float]         # tokens held (to eta.BUCKET) -> generations paused in
    # pending between rounds (estimated: in_flight_ages)
    speeds: dict[str, float]         # GPU -> its requests' output tokens/s (complete.lua)
    retry_waiting: dict[str, int]    # GPU -> retries waiting for their ETA in a worker
    workers: dict[str, dict]         # GPU -> the worker's registration
    heartbeats: dict[str, float]     # GPU -> Redis time of the worker's last heartbeat
    servers: dict[str, dict]         # GPU -> its SGLang server's /metrics sample
    breakers: dict[str, dict]        # GPU -> its worker's circuit breaker (breaker.py)
    beat_seen: float | None          # Redis time of beat's last tick
    sealing_batch: str | None        # the batch being sealed
    storage_error: dict[str, str]    # empty while storage works
    hold: dict[str, str]             # the job's dispatch hold (dispatch/hold.py); empty: none
    memory_hold: dict | None         # Redis's memory hold, for every job; None: none
    quality: dict | None             # the quality monitor's last figures
    updated_at: float                # the wall clock when read


def _held_bucket(held: int) -> int:
    """The middle of held's 64-token bucket (eta.BUCKET): what a paused generation counts as."""
    return held // eta.BUCKET * eta.BUCKET + eta.BUCKET // 2


def _triples(flat: list, pairs: bool = False) -> list[tuple[int, ...]]:
    """A script's flat list of integers, in threes (or twos)."""
    size = 2 if pairs else 3
    return [tuple(int(v) for v in flat[i:i + size]) for i in range(0, len(flat) - size + 1, size)]


class _NamedMulti:
    """A MULTI whose results come back by name, not by position."""

    def __init__(self, r: redis.Redis):
        self._pipe = r.pipeline(transaction=True)
        self._names: list[Hashable] = []

    def named(self, name: Hashable) -> redis.client.Pipeline:
        """The pipeline, to queue the one command whose result `execute` returns as `name`."""
        self._names.append(name)
        return self._pipe

    def execute(self) -> dict[Hashable, Any]:
        return dict(zip(self._names, self._pipe.execute(), strict=True))


def read(r: redis.Redis, name: JobName, s: Settings) -> Reads:
    job = jobs.load(r, name)
    if job is None:
        raise KeyError(f"no job named {name!r}")
    seconds, micros = r.time()
    now = seconds + micros / 1e6
    window_start = now - s.rate_window_s
    buckets = range(int(window_start - window_start % RATE_BUCKET_S), int(now) + 1, RATE_BUCKET_S)
    gpus = dispatch.job_gpus(r, job)
    series = rate_series(gpus)

    multi = _NamedMulti(r)
    multi.named("counters").hgetall(job.name.counters)
    multi.named("pending").llen(job.name.pending)
    multi.named("unsealed").xlen(job.name.output)
    RATE_WINDOW(multi.named("rate"), rate=job.name.rate, first_bucket=buckets[0],
                last_bucket=buckets[-1], bucket_s=RATE_BUCKET_S, series=series)
    multi.named("workers").hgetall(WORKERS)
    multi.named("sealing").get(job.name.sealing)
    multi.named("storage_error").hgetall(job.name.storage_error)
    multi.named("hold").hgetall(job.name.hold)
    multi.named("memory_hold").get(MEMORY_HOLD)
    multi.named("heartbeats").hgetall(WORKERS_SEEN)
    multi.named("servers").hgetall(SERVERS)
    multi.named("breakers").hgetall(BREAKERS)
    multi.named("beat_seen").get(BEAT_SEEN)
    # Retries waiting for their ETA are in flight too: those of the GPU's `retrying` set (retry.lua
    # adds them) still in flight there, counted inside Redis in the same transaction as every
    # other count, so pending + in flight + waiting + completed + failed equals the total at that
    # instant, at the cost of the retries waiting, whatever the broker holds.
    for gpu in gpus:
        multi.named(("in_flight", gpu)).zcard(job.name.inflight(gpu))
        # when they were sent and what they held, for what each has generated so far (the token
        # ETA: eta.py), counted in Redis in strata of age
        IN_FLIGHT_AGES(multi.named(("sent_at", gpu)), inflight=job.name.inflight(gpu),
                       going_on=job.name.going_on, strata=IN_FLIGHT_STRATA)
        multi.named(("waiting", gpu)).zintercard(
            2, [job.name.inflight(gpu), job.name.retrying(gpu)])
    # The quality monitor's figures (training/data/monitor.py writes the key) at its last tick.
    multi.named("quality").get(job.name.quality("figures"))
    multi.named("speeds").hgetall(job.name.speed)
    GOING_ON_COUNTS(multi.named("going_on"), going_on=job.name.going_on)
    got = multi.execute()
    sent = {gpu: _triples(got[("sent_at", gpu)]) for gpu in gpus}  # oldest first, as ZRANGE
    # Generations going on from a round or a move, less those in flight: paused in pending. The
    # ones in flight are known by in_flight_ages' strata, a sample: the paused are as many as the
    # sample leaves, spread like all those going on, by the ETA's 64-token bucket.
    going_on: dict[int, int] = {}
    for held, count in _triples(got["going_on"], pairs=True):
        going_on[_held_bucket(held)] = going_on.get(_held_bucket(held), 0) + count
    moving = sum(count for triples in sent.values() for _, held, count in triples if held)
    share = max(0, sum(going_on.values()) - moving) / max(1, sum(going_on.values()))
    paused = {held: count * share for held, count in going_on.items()}

    window = dict(zip(series, got["rate"], strict=True))
    sealing, beat_seen, quality = got["sealing"], got["beat_seen"], got["quality"]
    return Reads(
        job=job,
        gpus=gpus,
        now=now,
        window_start=buckets[0],
        window=window,
        counters={key.decode(): int(v) for key, v in got["counters"].items()},
        pending=got["pending"],
        unsealed_rows=got["unsealed"],
        in_flight_set={gpu: got[("in_flight", gpu)] for gpu in gpus},
        sent_at=sent,
        paused={held: n for held, n in paused.items() if n > 0},
        speeds={key.decode(): float(v) for key, v in got["speeds"].items()},
        retry_waiting={gpu: got[("waiting", gpu)] for gpu in gpus},
        workers={key.decode(): json.loads(v) for key, v in got["workers"].items()},
        heartbeats={key.decode(): float(v) for key, v in got["heartbeats"].items()},
        servers={key.decode(): json.loads(v) for key, v in got["servers"].items()},
        breakers={key.decode(): json.loads(v) for key, v in got["breakers"].items()},
        beat_seen=float(beat_seen) if beat_seen else None,
        sealing_batch=json.loads(sealing)["name"] if sealing else None,
        storage_error={key.decode(): v.decode() for key, v in got["storage_error"].items()},
        hold={key.decode(): v.decode() for key, v in got["hold"].items()},
        memory_hold=json.loads(got["memory_hold"]) if got["memory_hold"] else None,
        quality=json.loads(quality) if quality else None,
        updated_at=time.time(),
    )


# -- compute: pure functions of Reads -----------------------------------------------------------

def count(reads: Reads, counter: str) -> int:
    return reads.counters.get(counter, 0)


def tally(reads: Reads, prefix: str) -> dict[str, int]:
    """The counters "<prefix>:<name>" as {name: count} (finish reasons, retry reasons)."""
    return {key.split(":", 1)[1]: v for key, v in reads.counters.items()
            if key.startswith(f"{prefix}:")}


def histogram(reads: Reads, prefix: str) -> dict[int, int]:
    """The counters "<prefix><bucket>" that hold rows, as {bucket: rows}."""
    return {int(key[len(prefix):]): v for key, v in reads.counters.items()
            if key.startswith(prefix) and v > 0}


def window_span(reads: Reads) -> float:
    """The seconds the rate window covers: from its first bucket, or from the bucket of the
    job's first completion when that is later, to now; 0 before the first completion."""
    first = reads.counters.get("first_completed_at")
    if not first:
        return 0.0
    return reads.now - max(reads.window_start, first - first % RATE_BUCKET_S)


def per_second(reads: Reads, series: str) -> float:
    """A rate series (rate_series) per second over the window."""
    span = window_span(reads)
    return reads.window[series] / span if span > 0 else 0.0


def token_eta(reads: Reads, left: int, s: Settings) -> tuple[float | None, float | None]:
    """(hours, output tokens) left, from tokens (eta.py). The job's length distribution so far,
    the prompts not yet decoding (not sent, or waiting in a server's queue: beyond the requests
    its /metrics says run), and those decoding, each with what it has generated (what it held
    when sent, a generation going on from a round or a move, plus its time decoding, since
    then less its GPU's wait for a slot (_queue_wait), × its GPU's decode speed per request:
    the server's generation throughput over its running requests, else the job's measured
    speed there); one waiting with a round's or a move's tokens is longer than those. The
    end game's rounds are the deployment's (endgame_round_tokens). The fleet's rate is what it
    generates now, each GPU's speed × its requests decoding: the output tokens of the requests
    that ended in the window lag it by a request's length, most at the start, when only the
    short ones have ended. A job of conversations counts replies (eta_by_requests). (None,
    None) unless running, or before rows have ended."""
    if reads.job.status != "running":
        return None, None
    if reads.job.turns == "all":
        return eta_by_requests(reads, left, per_second(reads, "c")), None
    finished = histogram(reads, "hist:")
    known = [reads.speeds[gpu] for gpu in reads.gpus if reads.speeds.get(gpu)]
    if not finished or not known:
        return None, None
    cap = reads.job.params.max_tokens
    by_speed: dict[float, list[tuple[float, int]]] = {}
    waiting: dict[float, list[tuple[float, int]]] = {}  # by speed, (tokens held, how many)
    for gpu in reads.gpus:
        server = reads.servers.get(gpu) or {}
        running, generating = server.get("running"), server.get("gen_throughput")
        speed = (generating / running if running and generating
                 else reads.speeds.get(gpu) or sum(known) / len(known))
        # the longest in flight are the ones decoding (sent_at is oldest first)
        slots = None if running is None else int(running)
        speed_class = _speed_class(speed)
        decoding = by_speed.setdefault(speed_class, [])
        queued = waiting.setdefault(speed_class, [])
        queued_for = _queue_wait(reads.sent_at[gpu], slots, reads.now)
        for at, held, count in reads.sent_at[gpu]:
            taken = count if slots is None else min(count, slots)
            if taken:
                decoding.append((min(cap, held + max(0.0, reads.now - at - queued_for) * speed),
                                 taken))
            if count > taken:
                queued.append((held, count - taken))
            if slots is not None:
                slots -= taken
    in_flight = {speed: eta.censored_counted(so_far, cap) for speed, so_far in by_speed.items()}
    queued_at = {speed: eta.censored_counted(held, cap) for speed, held in waiting.items()}
    # every output known to be longer than it is: decoding, paused between rounds, or waiting
    # for a slot with the tokens of its earlier rounds (one waiting from nothing tells nothing)
    paused = eta.censored_counted(reads.paused.items(), cap)
    holding = eta.censored_counted(((held, n) for by_held in waiting.values()
                                    for held, n in by_held if held), cap)
    mass = eta.length_distribution(finished, eta.merged([*in_flight.values(), paused, holding]),
                                   cap)
    unsent = max(0, left - sum(reads.in_flight_set.values()) - sum(reads.paused.values()))
    tokens = eta.tokens_left(mass, unsent, eta.merged([*in_flight.values(), paused,
                                                       *queued_at.values()]))
    rate = sum(speed * sum(n for _, n in so_far) for speed, so_far in by_speed.items()) \
        or per_second(reads, "t")
    if rate <= 0:
        return None, tokens
    # The end game moves a generation from a GPU measurably slower than the fastest decoding
    # (take.lua; a GPU that decodes nothing, its server stalled or its breaker open, takes none).
    moved_below = max((speed for speed, groups in in_flight.items() if groups),
                      default=0.0) / s.endgame_faster_ratio
    return round(eta.seconds_left(mass, unsent, in_flight, rate, queued_at, moved_below, paused,
                                  s.endgame_round_tokens or None) / 3600, 5), tokens


def _queue_wait(sent_at: list[tuple[float, int, int]], slots: int | None, now: float) -> float:
    """How long a prompt waits for a slot on its GPU (0 with none waiting): the age of the
    oldest one still waiting, the next a slot takes (a GPU's server takes its queue in the order
    it was sent). A prompt decoding has generated for its age less that wait: the seconds it
    waited are no tokens, and counted as tokens (at 35 waiting for 40 slots, a second of a
    compressed run, 1,500) they made the outputs in flight look as long as the cap."""
    if slots is None:
        return 0.0
    for at, _, count in sent_at:
        if count > slots:
            return max(0.0, now - at)
        slots -= count
    return 0.0


def _speed_class(speed: float) -> float:
    """A GPU's speed rounded to 5%: GPUs of one speed are one group in the end's integral."""
    return 1.05 ** round(math.log(speed) / math.log(1.05)) if speed > 0 else speed


def eta_by_requests(reads: Reads, left: int, rate: float) -> float | None:
    """The time left at the rate of the window: prompts left over completions per second; for a
    job of conversations (enqueue --turns all), replies: each conversation left as many as the
    dataset's conversations have on average, over the replies made per second (handed on or
    ending a row), so a conversation's turns, each waiting on the last, count as the work they
    are from the first minutes, before any conversation has ended. None unless running."""
    if reads.job.status != "running":
        return None
    if reads.job.turns == "all" and reads.job.replies_per_prompt:
        left, rate = left * reads.job.replies_per_prompt, rate + per_second(reads, "r")
    return round(left / rate / 3600, 5) if rate > 0 else None


def remaining(reads: Reads) -> int:
    return max(0, count(reads, "total") - count(reads, "completed") - count(reads, "failed"))


def in_flight(reads: Reads, gpu: GpuName) -> int:
    """Sent, or queued to be sent: the in-flight set less the retries waiting for their ETA."""
    return reads.in_flight_set[gpu] - reads.retry_waiting[gpu]


def output_percentile(reads: Reads, q: float) -> int | None:
    """As `manage.py stats` reports it: a bucket's lower edge, or the cap for the bucket holding
    the cap (truncated outputs are exactly the cap)."""
    return length_percentile(histogram(reads, "hist:"), q, reads.job.params.max_tokens)


def latency_percentile_ms(reads: Reads, q: float) -> float | None:
    bucket = nearest_rank(histogram(reads, "lat:"), q)
    return round(latency_bucket_ms(bucket), 1) if bucket is not None else None


def heartbeat_age_s(reads: Reads, gpu: GpuName) -> float | None:
    beat = reads.heartbeats.get(gpu)
    return round(reads.now - beat, 1) if beat is not None else None


def _share_pct(part: int, whole: int) -> float:
    return round(100 * part / whole, 2) if whole else 0.0


def _mean(total: int, n: int) -> float:
    return round(total / n, 1) if n else 0.0


# -- render --------------------------------------------------------------------------------------

def _aliased(fields: dict) -> dict:
    """fields with each ALIASES name added right after the figure it names."""
    out = {}
    for key, value in fields.items():
        out[key] = value
        if key in ALIASES:
            out[ALIASES[key]] = value
    return out


def gpu_state(reads: Reads, gpu: GpuName, alive: bool) -> tuple[str, str | None]:
    """Whether the GPU takes work, and if not why: "serving"; "no_worker" (none registered, or
    stopped, or its heartbeat went silent); or its open breaker's kind (breaker.py: "transient",
    the server does not answer; "misconfigured"; "repeated_failure"; "waiting_for_server", a
    worker started before its server answers) with its last error."""
    if not alive:
        return "no_worker", ("its worker stopped or was never started" if gpu not in reads.heartbeats
                             else "no heartbeat from its worker")
    breaker = reads.breakers.get(gpu) or {}
    if breaker.get("state") == "open":
        return str(breaker.get("kind", "transient")), breaker.get("last_error")
    return "serving", None


def render_gpu(reads: Reads, gpu: GpuName, s: Settings) -> dict:
    age = heartbeat_age_s(reads, gpu)
    alive = age is not None and age < ALIVE_PERIODS * s.worker_heartbeat_s
    state, why = gpu_state(reads, gpu, alive)
    return _aliased({
        "node": gpu.node,
        "state": state,
        "state_reason": why,
        "completed": count(reads, f"gpu:{gpu}:completed"),
        "output_tokens": count(reads, f"gpu:{gpu}:output_tokens"),
        "request_throughput": round(per_second(reads, f"{gpu}:c"), 3),
        "output_tokens_per_sec": round(per_second(reads, f"{gpu}:t"), 1),
        "in_flight": in_flight(reads, gpu),
        "retry_waiting": reads.retry_waiting[gpu],
        "retries": count(reads, f"gpu:{gpu}:retries"),
        "worker": reads.workers.get(gpu, {}).get("hostname"),
        "url": reads.workers.get(gpu, {}).get("url"),  # the server its worker calls (redacted)
        "alive": alive,
        "heartbeat_age_s": age,
        # The server's own view (its /metrics, sampled by the worker): running requests
        # below its decode slots while prompts are pending means the slots are not full.
        "server": _server_view(reads.servers.get(gpu), reads.now),
    })


def render_nodes(gpus: dict[str, dict]) -> dict:
    """Per node, the sums of its GPUs' views (render_gpu)."""
    nodes: dict[str, dict] = {}
    for view in gpus.values():
        node = nodes.setdefault(view["node"], {"gpus": 0, "alive": 0, "completed": 0, "in_flight": 0,
                                               "request_throughput": 0.0, "output_throughput": 0.0})
        node["gpus"] += 1
        node["alive"] += view["alive"]
        node["completed"] += view["completed"]
        node["in_flight"] += view["in_flight"]
        node["request_throughput"] = round(node["request_throughput"] + view["request_throughput"], 3)
        node["output_throughput"] = round(node["output_throughput"] + view["output_throughput"], 1)
    return nodes


def render(reads: Reads, s: Settings) -> dict:
    job, now = reads.job, reads.now
    completed, left = count(reads, "completed"), remaining(reads)
    in_tokens, out_tokens = count(reads, "input_tokens"), count(reads, "output_tokens")
    rate = per_second(reads, "c")
    hours_left, tokens_left = token_eta(reads, left, s)
    finish_reasons = tally(reads, "finish")
    lat_n = count(reads, "latency_n")
    err = reads.storage_error
    gpus = {gpu: render_gpu(reads, gpu, s) for gpu in reads.gpus}
    output = job.output or s.output_location()
    return _aliased({
        "job": job.name,
        "status": job.status,
        "total": count(reads, "total"),
        "completed": completed,
        "failed": count(reads, "failed"),
        "pending": reads.pending,
        "in_flight": sum(in_flight(reads, gpu) for gpu in reads.gpus),
        "retry_waiting": sum(reads.retry_waiting.values()),
        "remaining": left,
        # Why the job's dataset is not all stored (an enqueue interrupted), or null
        "incomplete": job.incomplete or None,
        # A job of conversations (enqueue --turns all): the replies made, each conversation's
        # last with its row, the others handed on to their next turn (next_round.lua).
        "turns": {"replies": count(reads, "turns") + completed, "handed_on": count(reads, "turns")}
        if job.turns == "all" else None,
        "retries": count(reads, "retries"),
        "retry_reasons": tally(reads, "retry"),
        "rate_per_sec": round(rate, 3),
        "output_tokens_per_sec": round(per_second(reads, "t"), 1),
        "input_throughput": round(per_second(reads, "i"), 1),
        "rate_window_s": s.rate_window_s,
        # Only a running job ends: a paused, cancelled or done one has no time left to show.
        "eta_hours": hours_left,
        # The output tokens the prompts left are expected to generate (eta.py)
        "output_tokens_left": round(tokens_left) if tokens_left is not None else None,
        # The request-rate formula eta_hours replaced, for comparison (eta.py says why)
        "eta_hours_by_requests": eta_by_requests(reads, left, rate),
        "elapsed_hours": round((now - job.created_at) / 3600, 4),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "avg_input_tokens": _mean(in_tokens, completed),
        "avg_output_tokens": _mean(out_tokens, completed),
        "median_output_tokens": output_percentile(reads, 0.5),
        "p90_output_tokens": output_percentile(reads, 0.9),
        "short_output_pct": _share_pct(histogram(reads, "hist:").get(0, 0), completed),
        "finish_reasons": finish_reasons,
        "truncated_pct": _share_pct(finish_reasons.get("length", 0), completed),
        # The truncated rows, looping or still progressing (output/loops.py)
        "truncated": truncated_split(reads.counters),
        "mean_e2e_latency_ms": round(count(reads, "latency_ms_sum") / lat_n, 1) if lat_n else None,
        "median_e2e_latency_ms": latency_percentile_ms(reads, 0.5),
        "p90_e2e_latency_ms": latency_percentile_ms(reads, 0.9),
        "p99_e2e_latency_ms": latency_percentile_ms(reads, 0.99),
        "latency_rows": lat_n,
        "batches": count(reads, "batches"),
        "batch_bytes": count(reads, "batch_bytes"),
        "s3_uploaded": count(reads, "s3_uploaded"),
        "s3_bytes": count(reads, "s3_bytes"),
        "output": output,
        "s3_uri": output if output.startswith("s3://") else None,
        "unsealed_rows": reads.unsealed_rows,
        "sealing_batch": reads.sealing_batch,
        "storage_error": ({"error": err.get("error"), "since": float(err.get("since", 0)),
                           "failures": int(err.get("failures", 0))} if err else None),
        "spooled_batches": count(reads, "spooled"),
        "spooled_bytes": count(reads, "spooled_bytes"),
        "dispatch_held": dispatch_held(reads),
        "params": {"max_tokens": job.params.max_tokens, "temperature": job.params.temperature,
                   "top_p": job.params.top_p, "top_k": job.params.top_k,
                   "enable_thinking": job.params.enable_thinking},
        "gpu_selection": job.selection.describe(),
        "gpus": gpus,
        "nodes": render_nodes(gpus),
        # Seconds since beat's last tick (None: never). Without beat nothing is sealed, shipped
        # or marked done: `status` says so.
        "beat_age_s": round(now - reads.beat_seen, 1) if reads.beat_seen is not None else None,
        "quality": reads.quality,
        "updated_at": round(reads.updated_at, 3),
    })


def snapshot(r: redis.Redis, name: JobName, s: Settings) -> dict:
    return render(read(r, name, s), s)


def sealing_counts(r: redis.Redis, name: JobName) -> dict[str, int]:
    """What beat's sealing decides on, in one transaction: the prompts' outcomes against the
    total, pending, the rows waiting, the batches in the spool (snapshot's names)."""
    pipe = r.pipeline(transaction=True)
    pipe.hmget(name.counters, "total", "completed", "failed", "spooled")
    pipe.llen(name.pending)
    pipe.xlen(name.output)
    (total, completed, failed, spooled), pending, unsealed = pipe.execute()
    return {"total": int(total or 0), "completed": int(completed or 0), "failed": int(failed or 0),
            "spooled_batches": int(spooled or 0), "pending": pending, "unsealed_rows": unsealed}


def dispatch_held(reads: Reads) -> dict | None:
    """Why no new work starts (dispatch/hold.py), or None: the job's own hold (its batches can
    go nowhere), else Redis's memory hold."""
    if reads.hold:
        return {"reason": reads.hold.get("reason"), "error": reads.hold.get("error"),
                "since": float(reads.hold.get("since", 0))}
    if reads.memory_hold:
        m = reads.memory_hold
        return {"reason": "redis_memory", "error": f"Redis uses {m['used_memory']} of its maxmemory "
                f"{m['maxmemory']} bytes (hold at {m['ratio']:.0%}) with "
                f"{m.get('rows_to_seal', '?')} rows waiting to be sealed: beat seals them, and "
                "dispatch resumes by itself once Redis is below the hold", "since": m["since"]}
    return None


def _server_view(sample: dict | None, now: float) -> dict | None:
    if sample is None:
        return None
    view = {k: sample.get(k) for k in ("running", "queued", "gen_throughput", "token_usage",
                                       "cache_hit_rate", "error")}
    view["age_s"] = round(now - sample["at"], 1)
    return view


def is_finished(snap: dict) -> bool:
    """Every prompt has an outcome and every row is in a batch in the storage (none waits in
    Redis nor in the spool)."""
    return (snap["total"] > 0 and snap["completed"] + snap["failed"] >= snap["total"]
            and snap["pending"] == 0 and snap["unsealed_rows"] == 0
            and snap.get("sealing_batch") is None and not snap.get("spooled_batches"))


def prune_rate(r: redis.Redis, name: JobName, gpus: list[GpuName], keep_s: float) -> int:
    """Delete the rate buckets older than keep_s, so the rate hash stays small in a run of
    days. Walks only the buckets since the last prune (idempotent: two beats may both run it)."""
    seconds, _ = r.time()
    cutoff = int(seconds - keep_s)
    cutoff -= cutoff % RATE_BUCKET_S
    start = r.hget(name.rate, "pruned_before") or r.hget(name.counters, "first_completed_at")
    if start is None:
        return 0
    start = int(start) - int(start) % RATE_BUCKET_S
    deleted = 0
    fields: list[str] = []
    for bucket in range(start, cutoff, RATE_BUCKET_S):
        fields.extend(rate_fields(bucket, gpus))
        if len(fields) >= 2000:
            deleted += r.hdel(name.rate, *fields)
            fields = []
    if fields:
        deleted += r.hdel(name.rate, *fields)
    if cutoff > start:
        r.hset(name.rate, "pruned_before", cutoff)
    return deleted


# -- the file ------------------------------------------------------------------------------------

def progress_key(job: str) -> str:
    """Where the job's progress.json lies in a storage: beside its batches and manifest."""
    return f"{job}/progress.json"


def write_progress(storage: Storage, job: str, snap: dict) -> None:
    storage.put(progress_key(job), json.dumps(snap, indent=1).encode())


def read_progress(storage: Storage, job: str) -> dict | None:
    """The job's progress.json; None when there is none or it is not one (not a JSON object).
    A storage that does not answer raises StorageError: a reader that waits for the job must not
    take an outage for a missing file."""
    try:
        snap = json.loads(storage.get(progress_key(job)))
    except (StorageNotFound, ValueError):
        return None
    return snap if isinstance(snap, dict) else None
