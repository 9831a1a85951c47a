"""progress.json: its figures checked against the ledger and the rows shipped, its rate over a
recent window, its cost independent of the job's size, and per-GPU liveness from heartbeats."""
from __future__ import annotations

import hashlib
import json
import statistics
from collections import Counter

import pytest
import redis as redis_lib
from support import wait_until
from test_pipeline import dataset, start

from dflash_tasks.core import jobs
from dflash_tasks.core.keys import JobName
from dflash_tasks.output import sealing

REQUIRED = ("total", "completed", "failed", "rate_per_sec", "eta_hours", "total_input_tokens",
            "total_output_tokens", "avg_output_tokens", "elapsed_hours", "s3_uploaded", "s3_bytes",
            "status", "output_tokens_per_sec", "pending", "in_flight", "retries", "finish_reasons",
            "truncated_pct", "gpus", "request_throughput", "input_throughput", "output_throughput",
            "mean_e2e_latency_ms", "median_e2e_latency_ms", "p90_e2e_latency_ms", "p99_e2e_latency_ms")
PER_GPU = ("completed", "output_tokens_per_sec", "output_throughput", "request_throughput",
           "in_flight", "alive", "worker", "heartbeat_age_s")


# -- end to end ----------------------------------------------------------------------------------

def test_progress_json_matches_the_ledger_and_the_rows(cluster, tmp_path):
    # No age deadline: on a loaded machine a 2 s lull would seal a partial batch, and this test
    # counts batches by size (600 rows / 150). Sealing on age has its own tests.
    c = cluster(batch_rows=150, batch_max_age_s=3600, rate_window_s=60, worker_heartbeat_s=1)
    start(c)
    path, ids = dataset(tmp_path, 600)
    c.manage("enqueue", "--dataset", str(path), "--job", "prog", "--gpus", "2",
             "--max-output-tokens", "4096")
    progress = c.output_dir / "prog" / "progress.json"

    # While it runs: a rate, an ETA, work in flight, both workers alive.
    def running_snapshot():
        if not progress.exists():
            return None
        snap = json.loads(progress.read_text())
        return (snap["status"] == "running" and 0 < snap["completed"] < 600 and snap["rate_per_sec"] > 0
                and snap["eta_hours"] is not None and snap["in_flight"] > 0 and snap) or None

    live = wait_until(running_snapshot, timeout=120, interval=0.2, what="a running progress.json")
    for field in REQUIRED:
        assert field in live, field
    assert live["total"] == 600 and live["request_throughput"] == live["rate_per_sec"]
    assert live["output_tokens_per_sec"] > 0 and live["input_throughput"] > 0
    assert live["eta_hours_by_requests"] == pytest.approx(
        (600 - live["completed"] - live["failed"]) / live["rate_per_sec"] / 3600, rel=0.01, abs=1e-3)
    # From tokens (eta.py, its accuracy in test_eta.py): the tokens left are at least those of
    # the prompts never sent at the shortest output seen, at most every prompt left at the cap.
    unsent = 600 - live["completed"] - live["failed"] - live["in_flight"]
    assert unsent * 1 <= live["output_tokens_left"] <= (600 - live["completed"]) * 4096
    assert live["eta_hours"] > 0
    assert set(live["gpus"]) == {c.gpu(0), c.gpu(1)}
    for g in live["gpus"].values():
        for field in PER_GPU:
            assert field in g, field
        assert g["alive"] is True and g["worker"]

    c.wait_done("prog")
    final = json.loads(progress.read_text())
    rows = c.rows("prog")
    assert len(rows) == 600 and {r["id"] for r in rows} == ids
    meta = [r["metadata"] for r in rows]
    out_tokens = sum(m["completion_tokens"] for m in meta)
    reasons = Counter(m["finish_reason"] for m in meta)
    ledger = {k.decode(): int(v) for k, v in c.r.hgetall(JobName("prog").counters).items()}
    assert final["status"] == "done"
    assert final["total"] == final["completed"] == ledger["completed"] == 600
    assert final["failed"] == ledger.get("failed", 0) == 0
    assert final["pending"] == 0 and final["in_flight"] == 0 and final["unsealed_rows"] == 0
    assert final["total_input_tokens"] == ledger["input_tokens"] == sum(m["prompt_tokens"] for m in meta)
    assert final["total_output_tokens"] == ledger["output_tokens"] == out_tokens
    assert final["avg_output_tokens"] == round(out_tokens / 600, 1)
    assert final["finish_reasons"] == dict(reasons)
    assert final["truncated_pct"] == round(100 * reasons["length"] / 600, 2) > 0
    assert final["retries"] == ledger.get("retries", 0)
    assert final["s3_uploaded"] == final["s3_bytes"] == 0  # no S3 configured
    assert final["batches"] == ledger["batches"] == 4
    assert final["elapsed_hours"] > 0
    for gpu in (0, 1):
        assert final["gpus"][c.gpu(gpu)]["completed"] == sum(1 for m in meta if m["gpu"] == c.gpu(gpu))
    # Latency, as SGLang's bench_serving names it, over every sealed row.
    latencies = [m["latency_s"] * 1000 for m in meta]
    assert final["latency_rows"] == 600
    assert final["mean_e2e_latency_ms"] == pytest.approx(statistics.mean(latencies), abs=1)
    assert final["median_e2e_latency_ms"] == pytest.approx(statistics.median(latencies), rel=0.13)
    assert final["p99_e2e_latency_ms"] >= final["p90_e2e_latency_ms"] >= final["median_e2e_latency_ms"]
    # `manage.py status --json` prints the same dictionary.
    assert set(c.status("prog")) == set(final)

    # A worker killed stops its heartbeat: alive turns false within three periods.
    c.workers[1].kill()
    wait_until(lambda: c.status("prog")["gpus"][c.gpu(1)]["alive"] is False, timeout=30,
               what="gpu1 to read as not alive")
    assert c.status("prog")["gpus"][c.gpu(0)]["alive"] is True
    # A worker stopped cleanly removes its stamp at once.
    c.workers[0].stop()
    assert c.status("prog")["gpus"][c.gpu(0)]["alive"] is False


# -- in process, against the test database ---------------------------------------------------------

def _row(i: int, gpu: str, out: int, latency_s: float, reason: str = "stop") -> dict:
    return {"id": f"p{i}", "conversations": [], "status": "success", "metadata": {
        "finish_reason": reason, "prompt_tokens": 10, "completion_tokens": out, "gpu": gpu,
        "latency_s": latency_s, "attempts": 1, "completed_at": 1_700_000_000 + i}}


@pytest.fixture
def r(redis_url):
    return redis_lib.Redis.from_url(redis_url)


def _gpu(index: int) -> str:
    return f"gpu{index}@a"


def _job(r, name: str, n: int, gpus: int = 2):
    name = JobName(name)
    from dflash_tasks.ledger import Ledger

    book = Ledger(r)
    jobs.save(r, name, jobs.GenerationParams(), selection=jobs.GpuSelection.parse(str(gpus)),
              dataset="x", status="running")
    for gpu in range(gpus):  # as if each had dispatched: status shows the job's GPUs
        r.sadd(JobName(name).gpus, _gpu(gpu))
    book.add_prompts(name, [(f"p{i}", "[]") for i in range(n)])
    return book


def _settings(**kw):
    from dflash_tasks.core.settings import Settings

    return Settings(**kw)


def test_rate_is_over_the_recent_window_not_since_the_start(r):
    from dflash_tasks.output.progress import RATE_BUCKET_S, snapshot

    book = _job(r, "win", 100)
    for i in range(30):
        book.complete(JobName("win"), f"p{i}", _gpu(i % 2), _row(i, _gpu(i % 2), 100 * (1 + i % 2), 1.0))
    k = JobName("win")
    now = int(r.time()[0])
    old = now - 3600 - now % RATE_BUCKET_S
    # An hour ago, a burst of 10,000 completions: outside a 300 s window, so it must not count.
    r.hset(k.rate, mapping={f"c:{old}": 10_000, f"t:{old}": 10**7, f"{_gpu(0)}:c:{old}": 10_000})
    r.hset(k.counters, "first_completed_at", old)
    snap = snapshot(r, JobName("win"), _settings(rate_window_s=300))
    span = now - (now - 300 - (now - 300) % RATE_BUCKET_S) + r.time()[1] / 1e6
    assert snap["rate_per_sec"] == pytest.approx(30 / span, rel=0.05)
    assert snap["output_tokens_per_sec"] == pytest.approx(4500 / span, rel=0.05)
    assert snap["input_throughput"] == pytest.approx(300 / span, rel=0.05)
    assert snap["gpus"][_gpu(0)]["request_throughput"] == pytest.approx(15 / span, rel=0.05)
    assert snap["gpus"][_gpu(1)]["output_tokens_per_sec"] == pytest.approx(3000 / span, rel=0.05)
    assert snap["nodes"]["a"]["request_throughput"] == pytest.approx(30 / span, rel=0.05)
    assert snap["nodes"]["a"]["gpus"] == 2
    assert snap["eta_hours_by_requests"] == pytest.approx(70 / snap["rate_per_sec"] / 3600,
                                                          rel=0.01)


def test_a_conversation_jobs_eta_counts_its_replies_from_the_first_minutes(r):
    """Before any conversation has ended, its replies are being made: the ETA of a job of
    conversations (--turns all) is its replies left over the replies made per second, not
    conversations over conversations done (none yet: no ETA at all)."""
    from dflash_tasks.dispatch import window
    from dflash_tasks.output.progress import RATE_BUCKET_S, snapshot

    book = _job(r, "talk", 100)
    k = JobName("talk")
    r.hset(k.config, mapping={"turns": "all", "replies_per_prompt": "5.0000"})
    for i in range(40):  # 40 conversations' first replies made, each handed on to its next
        r.zadd(k.inflight(_gpu(i % 2)), {f"p{i}": 1})
        entry = r.hget(k.prompts, f"p{i}")
        assert window.next_round(r, k, f"p{i}", _gpu(i % 2), entry, 100,
                                 hashlib.sha1(entry).hexdigest(), turn=True)
    first = int(r.time()[0]) - 60
    r.hset(k.counters, "first_completed_at", first)
    snap = snapshot(r, k, _settings(rate_window_s=300))
    assert snap["completed"] == 0 and snap["turns"] == {"replies": 40, "handed_on": 40}
    assert snap["eta_hours"] is not None  # a rate of conversations done (none) would say nothing
    book.complete(k, "p0", _gpu(0), _row(0, _gpu(0), 100, 1.0))
    snap = snapshot(r, k, _settings(rate_window_s=300))
    span = r.time()[0] - (first - first % RATE_BUCKET_S)
    # 99 conversations left, 5 replies each, at 41 replies (40 handed on, 1 row) over the span
    assert snap["eta_hours"] == pytest.approx(99 * 5 / (41 / span) / 3600, rel=0.02)


def test_the_prompts_in_flight_are_read_in_strata_of_age_past_a_few(r):
    """A GPU's prompts in flight, read for the token ETA: one by one up to IN_FLIGHT_STRATA, past
    it in as many strata of consecutive ages, each counted whole at its middle prompt's age and
    tokens held: every prompt counted once, oldest first, each stratum's age inside its own
    prompts' span (the snapshot costs the same at 300 in flight as at 16)."""
    from dflash_tasks.output.progress import IN_FLIGHT_STRATA, read

    _job(r, "ages", 10)
    k = JobName("ages")
    now = int(r.time()[0])
    sent = {f"q{i}": now - 2 * i for i in range(300)}  # q0 the newest
    r.zadd(k.inflight(_gpu(0)), sent)
    r.zadd(k.inflight(_gpu(1)), {f"s{i}": now - i for i in range(5)})
    # every 10th prompt in flight on gpu0 goes on from a round (as 30 of 300), one on gpu1, and
    # 60 are paused in pending between rounds
    r.hset(k.going_on, mapping={**{f"q{i}": 4096 + i for i in range(0, 300, 10)}, "s3": 4200,
                                **{f"w{i}": 4100 for i in range(60)}})
    reads = read(r, k, _settings())
    many, few = reads.sent_at[_gpu(0)], reads.sent_at[_gpu(1)]
    assert sum(n for _, _, n in many) == 300 and len(many) == IN_FLIGHT_STRATA
    assert [at for at, _, _ in many] == sorted(at for at, _, _ in many)  # oldest first
    first = 0
    for at, held, n in many:  # ranks first..first+n-1 of the oldest-first order
        ages = [2 * (299 - rank) for rank in range(first, first + n)]
        assert min(ages) <= now - at <= max(ages), (at, n)
        assert held in (0, 4096 + (now - at) // 2), (at, held)  # its middle prompt's
        first += n
    assert few == [(now - 4, 0, 1), (now - 3, 4200, 1), (now - 2, 0, 1), (now - 1, 0, 1),
                   (now, 0, 1)]
    # the paused: as many as the sample leaves of the 91 going on, spread like them
    moving = sum(n for _, held, n in many + few if held)
    assert sum(reads.paused.values()) == pytest.approx(91 - moving)
    assert sum(reads.paused.values()) <= 90  # s3, read one by one, never counted paused


def test_old_rate_buckets_are_pruned(r):
    from dflash_tasks.output.progress import RATE_BUCKET_S, prune_rate

    book = _job(r, "prune", 10)
    book.complete(JobName("prune"), "p0", _gpu(0), _row(0, _gpu(0), 5, 1.0))
    k = JobName("prune")
    now = int(r.time()[0])
    old = now - 7200 - now % RATE_BUCKET_S
    r.hset(k.counters, "first_completed_at", old)
    r.hset(k.rate, mapping={f"c:{old}": 1, f"{_gpu(1)}:t:{old + 10}": 1, f"i:{old + 20}": 1})
    assert prune_rate(r, JobName("prune"), [_gpu(0), _gpu(1)], keep_s=600) == 3
    fields = {f.decode() for f in r.hkeys(k.rate)}
    assert not any(str(old) in f for f in fields) and any(f.startswith("c:") for f in fields)
    assert prune_rate(r, JobName("prune"), [_gpu(0), _gpu(1)], keep_s=600) == 0  # nothing left to walk twice


def test_reading_costs_the_same_at_any_size(r, monkeypatch):
    """The same Redis commands for 100 prompts as for 20,000: counters, not scans."""
    from dflash_tasks.output.progress import snapshot

    sent: list[str] = []
    real_execute = redis_lib.client.Pipeline.execute
    real_command = redis_lib.Redis.execute_command

    def execute(self, *a, **kw):
        sent.extend(str(args[0]).upper() for args, _ in self.command_stack)
        return real_execute(self, *a, **kw)

    def command(self, *args, **kw):
        name = str(args[0]).upper()
        # The broker's unacknowledged messages (waiting retries) are bounded by the GPU windows,
        # and the job's GPUs by the deployment, not by the job's size: those reads are allowed.
        if name == "HSCAN" and args[1] in ("unacked", b"unacked"):
            name = "HSCAN unacked"
        elif name == "SMEMBERS" and str(args[1]).endswith(":gpus"):
            name = "SMEMBERS gpus"
        sent.append(name)
        return real_command(self, *args, **kw)

    def commands_for(name: str, n: int) -> list[str]:
        name = JobName(name)
        book = _job(r, name, n)
        pipe = r.pipeline(transaction=False)
        for i in range(n // 2):
            pipe.sadd(name.done, f"p{i}")
        pipe.hincrby(name.counters, "completed", n // 2)
        pipe.execute()
        book.complete(name, "p0x", _gpu(0), _row(0, _gpu(0), 5, 1.0))
        sent.clear()
        monkeypatch.setattr(redis_lib.client.Pipeline, "execute", execute)
        monkeypatch.setattr(redis_lib.Redis, "execute_command", command)
        try:
            snapshot(r, name, _settings())
        finally:
            monkeypatch.undo()
        return list(sent)

    small, large = commands_for("small", 100), commands_for("large", 20_000)
    assert small == large
    assert not {"SCAN", "SSCAN", "HSCAN", "SMEMBERS", "HVALS", "XRANGE", "KEYS", "LRANGE"} & set(small)


def test_latency_percentiles_and_s3_totals_are_counted_once_per_batch(r, tmp_path):
    from dflash_tasks.ledger import Ledger
    from dflash_tasks.output.batches import BatchPolicy, BatchWriter
    from dflash_tasks.output.progress import snapshot
    from dflash_tasks.output.storage import LocalStorage

    class FakeRemote(LocalStorage):
        is_remote = True

    book = _job(r, "lat", 200)
    latencies = [0.5 + i * 0.05 for i in range(200)]
    for i, lat in enumerate(latencies):
        book.complete(JobName("lat"), f"p{i}", _gpu(i % 2),
                      _row(i, _gpu(i % 2), 50, lat, "length" if i % 4 == 0 else "stop"))
    writer = BatchWriter(r, Ledger(r), FakeRemote(tmp_path), BatchPolicy(rows=64, bytes=10**9, max_age_s=999))
    names = writer.flush(JobName("lat"), final=True)
    assert len(names) == 4
    writer.flush(JobName("lat"), final=True)  # nothing more, nothing counted twice
    # A batch recorded again (a retried step) adds nothing.
    rec = json.loads(r.hget(JobName("lat").manifest, names[0]))
    assert not sealing.record_batch(r, JobName("lat"), names[0], rec, stats={"latency_n": 999})

    snap = snapshot(r, JobName("lat"), _settings())
    ms = sorted(x * 1000 for x in latencies)
    assert snap["latency_rows"] == 200
    assert snap["mean_e2e_latency_ms"] == pytest.approx(statistics.mean(ms), abs=0.5)
    assert snap["median_e2e_latency_ms"] == pytest.approx(statistics.median(ms), rel=0.07)
    assert snap["p99_e2e_latency_ms"] == pytest.approx(ms[197], rel=0.07)
    assert snap["s3_uploaded"] == snap["batches"] == 4
    assert snap["s3_bytes"] == snap["batch_bytes"] == sum(
        json.loads(v)["bytes"] for v in r.hvals(JobName("lat").manifest))
    assert snap["truncated_pct"] == 25.0
    assert snap["short_output_pct"] == 100.0  # every output under 64 tokens: the alarm is on
    from dflash_tasks.output.batches import read_manifest
    from dflash_tasks.output.storage import LocalStorage

    manifest = read_manifest(LocalStorage(tmp_path), "lat")
    assert [b["name"] for b in manifest["batches"]] == sorted(names) and manifest["rows"] == 200
