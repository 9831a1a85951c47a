"""`make bench`: the orchestration's performance, measured beside baselines in one run.

Real redis-server, real Celery workers and simulated SGLang servers (decode slots, per-request
decode speed, the real run's output-length distribution), all started here as processes.

1. makespan / ideal, 4 equal servers x 40 slots, 16,000 prompts      goal <= 1.03
2. makespan / ideal, the same with one server 1.5x slower             goal <= 1.05
3. slot occupancy, first request to the point the pending work runs out  goal >= 0.98
4. completions/s with servers that answer at once, beside a worker
   draining no-op Celery tasks                                        goal >= 400/s
5. enqueue of 1,000,000 prompts: time, Redis memory, status/progress latency, resume; with the
   prompt bodies in Redis, and kept on the output storage (`enqueue --bodies storage`)
6. an S3 outage mid-run: Redis memory flat over the outage, every row in S3 once after it
7. the end game: case 2 with 3,000 prompts (~19 per slot)                goal <= 1.10
8. 64 GPUs on 4 simulated nodes: makespan / ideal, occupancy, Redis commands, CPU and memory
   per process kind, beat's tick
9. `make bench-10m`, not in the default run: case 5 with 10,000,000 prompts, bodies on storage
10-12. the seed's run at its own scale (benchmarks/seed_run.py): truncated rows continued with
   their prefixes out of Redis; status and beat's tick at 64 GPUs whatever the broker holds;
   the bytes written for a manifest over 1,000 batches
13. a continuation round (1,000 rows cut at 4,096 continued to 8,192, all long) on 4 servers,
   one 1.5x slower: makespan / ideal                                   goal <= 1.10
14. the end game's Redis at 64 GPUs x 64 slots: ~47,000 generations of 8,192 random ids
   handed on between rounds                                            goal < 200 MB
15. the end game's moves on prompt ids that begin one another: every abort is a move's own
16. conversations whose every reply is generated (`--turns all`) against a single-turn job of
   the same replies: throughput                                        goal >= 0.90
17. what conversations between replies hold in Redis at 64 GPUs x 300 in flight, their prompts'
   texts in Redis and on storage                                       goal < 200 MB on storage
18. the ETA on a run of the seed's shape (18% at a 4,096 cap, one server 1.5x slower): its error
   against the time left, from 10% of the run on (benchmarks/eta_run.py)  goal <= 10%
19. the peak memory of one reference training step on an 8,192-token row, the loss over the
   vocabulary in chunks against at once (benchmarks/train_memory.py)     goal <= 0.25x

Cases 1-3 run the project and the baseline (benchmarks/baseline.py: one asyncio process, a static
round-robin split, a semaphore per server) at the same time, each on its own four servers, so both
see the same machine. The table goes to stdout and to benchmarks/RESULTS.md.

    .venv/bin/python -m benchmarks [--quick] [--cases 1,2,4,5,6,7,8,10,11,12,13,14,15,16,17,18]
        [--results PATH]
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import (  # noqa: E402
    conversations,
    data,
    eta_run,
    measure,
    profile,
    report,
    seed_run,
    train_memory,
)
from dflash_dev.local import LocalCluster, free_port, wait_until  # noqa: E402
from dflash_tasks.core.keys import JobName  # noqa: E402
from dflash_tasks.core.settings import Settings  # noqa: E402
from dflash_tasks.ingest.prompts import read_prompts  # noqa: E402

README = ROOT / "README.md"
DEFAULT_CASES = "1,2,4,5,6,7,8,10,11,12,13,14,15,16,17,18,19"
CACHE = Path(os.environ.get("DFLASH_BENCH_CACHE", Path(tempfile.gettempdir()) / "dflash-bench"))


@dataclass
class Config:
    servers: int = 4
    slots: int = 40
    prompts: int = 16_000            # cases 1-3: 100 per slot
    decode_tps: float = 1500.0       # per request: ~96 requests/s per system (RESULTS.md)
    slow_factor: float = 1.5
    max_tokens: int = 8192
    overhead_prompts: int = 6_000    # case 4
    overhead_tokens: int = 16        # case 4: every answer this long, at once
    noop_tasks: int = 6_000
    concurrency: int | None = None   # GPU workers' threads [manage.py worker's default]
    scale_prompts: int = 1_000_000   # case 5, with the bodies in Redis and on storage
    scale_done: int = 990_000
    huge_prompts: int = 10_000_000   # case 9 (make bench-10m), the bodies on storage
    huge_done: int = 9_900_000
    outage_prompts: int = 12_000     # case 6: an S3 outage in the middle of a run
    outage_tokens: int = 1500        # every answer this long (rows of about 20 KB with their ids)
    outage_decode_tps: float = 1100.0  # per request: about 120 rows/s from 4 x 40 slots
    outage_warmup_s: float = 15.0
    outage_s: float = 90.0
    endgame_prompts: int = 3_000     # case 7: about 19 prompts per slot, one server slower
    many_nodes: int = 4              # case 8: simulated nodes (one LocalCluster each) ...
    many_gpus_per_node: int = 16     # ... of this many GPUs: 64
    many_slots: int = 16             # decode slots per server
    many_decode_tps: float = 250.0   # per request: about 100 requests/s from 1,024 slots
    many_prompts: int = 16_384       # 16 per slot
    seed_prompts: int = 10_000       # case 10: about 2,000 of them truncated and continued
    manifest_batches: int = 1_000    # case 12
    round_prompts: int = 1_000       # case 13: a continuation round, all long
    eta_prompts: int = 12_000        # case 18: the ETA, about 75 prompts per slot

    @classmethod
    def quick(cls) -> "Config":
        return cls(prompts=2_000, decode_tps=2500.0, overhead_prompts=3_000, noop_tasks=3_000,
                   scale_prompts=100_000, scale_done=99_000, huge_prompts=1_000_000,
                   huge_done=990_000, outage_prompts=4_000,
                   outage_warmup_s=8.0, outage_s=25.0, endgame_prompts=1_000,
                   many_nodes=2, many_gpus_per_node=8, many_prompts=2_048, seed_prompts=2_000,
                   manifest_batches=200, round_prompts=300, eta_prompts=3_000)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- cases 1-3 ----------------------------------------------------------------------------------

def makespan_case(cfg: Config, work: Path, name: str, dataset: Path, unit_times: list[float],
                  slow: list[float]) -> dict:
    root = work / name
    sim_args = ["--slots", str(cfg.slots), "--decode-tps", f"{cfg.decode_tps:g}"]
    extra = {i: ["--slow-factor", f"{f:g}"] for i, f in enumerate(slow) if f != 1.0}
    ours = LocalCluster(root / "logs", env={"DFLASH_OUTPUT_DIR": str(root / "output")})
    base = LocalCluster(root / "baseline-logs")
    with ours, base:
        ours.start_redis(free_port(), root / "redis")
        ours_urls = ours.start_servers(cfg.servers, sim_args, extra_args=extra)
        base_urls = base.start_servers(cfg.servers, sim_args, extra_args=extra)
        ours.start_workers(cfg.concurrency)
        ours.start_beat()
        r = redis.Redis.from_url(ours.env["DFLASH_REDIS_URL"])
        counters = JobName("bench").counters
        log(f"{name}: {cfg.prompts:,} prompts, ours and the baseline at once")
        with measure.ServerPoller(ours_urls + base_urls) as poller:
            pids = {n: p.pid for n, p in ours.named.items()}
            pids.update({f"baseline-{n}": p.pid for n, p in base.named.items()})
            meter = measure.CpuMeter(pids).start()
            machine0 = measure.machine_cpu_seconds()
            client = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.baseline", *base_urls, "--dataset", str(dataset),
                 "--out", str(root / "baseline-rows.jsonl"), "--slots", str(cfg.slots),
                 "--max-tokens", str(cfg.max_tokens)],
                cwd=ROOT, stdout=subprocess.PIPE, text=True)
            try:
                ours.manage("enqueue", "--dataset", str(dataset), "--job", "bench",
                            "--gpus", str(cfg.servers), "--max-output-tokens", str(cfg.max_tokens),
                            capture=True)
                limit = 4 * measure.ideal_makespan(unit_times, [cfg.slots] * cfg.servers, slow) + 300
                wait_until(lambda: sum(int(r.hget(counters, f) or 0)
                                       for f in ("completed", "failed")) >= cfg.prompts,
                           timeout=limit, interval=0.5, what="the project's run")
                baseline = json.loads(client.communicate(timeout=limit)[0])
            finally:
                if client.poll() is None:
                    client.kill()
                    client.wait()
            meter.stop()
            machine = measure.machine_cpu_seconds() - machine0
        c = {k.decode(): int(v) for k, v in r.hgetall(counters).items()}
        rounds = measure.round_figures(r, cfg.decode_tps)
    poller.save(root / "server-samples.json")
    n = cfg.servers
    ideal = measure.ideal_makespan(unit_times, [cfg.slots] * n, slow)
    ours_fig = measure.figures(poller.series[:n])
    generated = sum(s.final["completion_tokens"] for s in poller.series[:n])
    base_fig = measure.figures(poller.series[n:])
    return {
        "name": name, "slow": slow, "ideal_s": ideal, "work_s": sum(unit_times),
        **measure.references(unit_times, [cfg.slots] * n, slow, ideal, **rounds),
        "longest_s": max(unit_times), "wall_s": meter.wall,
        "ours": {**asdict(ours_fig), "ratio": ours_fig.makespan / ideal,
                 "completed": c.get("completed", 0), "failed": c.get("failed", 0),
                 # The end game's moves (issue 29), and the tokens decoded that no row kept.
                 **measure.end_game_counters(c),
                 "tokens_lost": generated - c.get("output_tokens", 0)},
        "baseline": {**asdict(base_fig), "ratio": base_fig.makespan / ideal,
                     "completed": baseline["completed"], "failed": baseline["failed"],
                     "client_cpu_s": baseline.get("cpu_s", 0.0)},
        "cpu_s": meter.grouped(), "machine_cpu_s": machine,
        # Each of our servers' last answer after the run's first request, and its slowness.
        "server_ends": [(s.final["last_finished_at"] - ours_fig.first_request, f)
                        for s, f in zip(poller.series[:n], slow) if s.final["last_finished_at"]],
    }


# -- case 4 -------------------------------------------------------------------------------------

def _rate(samples: list[tuple[float, int]], total: int) -> float:
    """Completions per second between 10% and 90% of `total` (start-up and tail left out)."""
    lo = next(s for s in samples if s[1] >= 0.1 * total)
    hi = next(s for s in samples if s[1] >= 0.9 * total)
    return (hi[1] - lo[1]) / (hi[0] - lo[0])


def noop_case(cfg: Config, work: Path) -> dict:
    root = work / "noop"
    with LocalCluster(root / "logs") as c:
        url = c.start_redis(free_port(), root / "redis")
        c.env["DFLASH_NOOP_BROKER"] = url
        from benchmarks import noop

        noop.app.conf.broker_url = url
        log(f"case 4: {cfg.noop_tasks:,} no-op tasks for a plain Celery worker")
        r = redis.Redis.from_url(url)
        # One message published by Celery itself, copied with fresh ids (publishing thousands
        # through kombu one by one would take longer than draining them).
        noop.app.send_task("noop", args=("noop", "p0", 0), queue="noop")
        template = json.loads(r.rpop("noop"))
        pipe = r.pipeline(transaction=False)
        for i in range(cfg.noop_tasks):
            template["headers"]["id"] = template["properties"]["correlation_id"] = f"noop-{i}"
            template["properties"]["delivery_tag"] = f"tag-{i}"
            pipe.lpush("noop", json.dumps(template))
        pipe.execute()
        worker = c.spawn("noop-worker", [sys.executable, "-m", "celery", "-A", "benchmarks.noop",
                                         "worker", "-Q", "noop", "-P", "threads", "-c", "40",
                                         "--without-gossip", "--without-mingle",
                                         "--without-heartbeat", "--loglevel", "WARNING"])
        samples: list[tuple[float, int]] = []
        cpu0 = None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            left = r.llen("noop") + r.hlen("unacked")
            done = cfg.noop_tasks - left
            if done > 0 and cpu0 is None:
                cpu0 = (time.monotonic(), measure.cpu_seconds(worker.pid), done)
            samples.append((time.monotonic(), done))
            if left == 0:
                break
            time.sleep(0.05)
        cpu = measure.cpu_seconds(worker.pid) - cpu0[1]
    return {"tasks": cfg.noop_tasks, "rate": _rate(samples, cfg.noop_tasks),
            "worker_cpu_ms_per_task": 1000 * cpu / (cfg.noop_tasks - cpu0[2])}


def overhead_case(cfg: Config, work: Path, dataset: Path, flower: bool = False) -> dict:
    """Case 4: with Flower off (as deployed unless someone watches), GPU worker 0 profiled with
    py-spy through the steady part; with Flower on (every worker sending task events), the rate
    alone."""
    name = "overhead-flower" if flower else "overhead"
    root = work / name
    sim_args = ["--slots", str(cfg.slots), "--decode-tps", "1e9", "--prefill-tps", "1e12",
                "--fixed-tokens", str(cfg.overhead_tokens)]
    with LocalCluster(root / "logs", env={"DFLASH_OUTPUT_DIR": str(root / "output")}) as c:
        c.start_redis(free_port(), root / "redis")
        c.start_servers(cfg.servers, sim_args)
        c.start_workers()
        c.start_beat()
        if flower:
            c.spawn("flower", [sys.executable, "manage.py", "flower", "--no-auth",
                               "--port", str(free_port())])
            wait_until(lambda: all("Events of group {task} enabled by remote" in w.log()
                                   for w in c.workers.values()),
                       timeout=60, what="Flower to turn the workers' events on")
        r = redis.Redis.from_url(c.env["DFLASH_REDIS_URL"])
        k = JobName(name)
        log(f"case 4: {cfg.overhead_prompts:,} prompts on servers that answer at once"
            f" (Flower {'on' if flower else 'off'})")
        meter = measure.CpuMeter({n: p.pid for n, p in c.named.items()}).start()
        started = time.monotonic()
        c.manage("enqueue", "--dataset", str(dataset), "--job", name, "--gpus",
                 str(cfg.servers), "--limit", str(cfg.overhead_prompts), capture=True)
        samples: list[tuple[float, int]] = []
        spy, raw = None, root / "worker0.pyspy.txt"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            done = int(r.hget(k.counters, "completed") or 0)
            samples.append((time.monotonic(), done))
            if done >= cfg.overhead_prompts:
                break
            if not flower and spy is None and done >= 0.1 * cfg.overhead_prompts:
                # Through the steady part: about half of what the run has left at this rate
                # (at most a minute: a rate read too early once asked py-spy for 40 minutes).
                left_s = 0.8 * cfg.overhead_prompts / max(1.0, _rate_so_far(samples))
                spy = profile.record(c.workers[0].pid, min(0.5 * left_s, 60.0), raw)
            time.sleep(0.1)
        completed_at = time.monotonic()
        meter.stop()
        wait_until(lambda: r.hget(k.config, "status") == b"done", timeout=120, interval=0.2,
                   what="the last rows sealed")
        sealed_at = time.monotonic()
        batches = int(r.hget(k.counters, "batches") or 0)
        profiled = None
        if spy is not None:
            try:
                _, err = spy.communicate(timeout=120)
            except subprocess.TimeoutExpired:  # py-spy writes what it has on SIGINT
                spy.send_signal(signal.SIGINT)
                _, err = spy.communicate(timeout=60)
            if raw.exists():
                parts, n = profile.shares(raw)
                profiled = {"parts": parts, "samples": n}
            else:
                log(f"case 4: py-spy wrote no profile: {err.strip()[-300:]}")
    n = cfg.overhead_prompts
    return {"prompts": n, "rate": _rate(samples, n), "flower": flower,
            "rate_incl_startup": n / (completed_at - started),
            "sealed_after_s": sealed_at - started, "batches": batches,
            "cpu_ms_per_completion": {g: 1000 * v / n for g, v in meter.grouped().items()
                                      if g != "flower"},
            "worker_profile": profiled}


def _rate_so_far(samples: list[tuple[float, int]]) -> float:
    (t0, n0), (t1, n1) = samples[0], samples[-1]
    return (n1 - n0) / max(1e-3, t1 - t0)


# -- case 5 -------------------------------------------------------------------------------------

def mark_done(r: redis.Redis, job: str, n: int, gpus: list[str]) -> None:
    """Put the job in the state it has after n completions (rows sealed and gone): the first n
    prompts (the dispatched ones first) in `done`, out of `prompts`/`pending`/in-flight, counted,
    and the GPU queues drained."""
    k = JobName(job)
    marked = 0
    for gpu in gpus:
        ids = [m for m, _ in r.zpopmin(k.inflight(gpu), 100_000)]
        if ids:
            r.sadd(k.done, *ids)
            r.hdel(k.prompts, *ids)
            marked += len(ids)
        r.delete(gpu)
    while marked < n:
        ids = r.lpop(k.pending, min(10_000, n - marked))
        pipe = r.pipeline(transaction=False)
        pipe.sadd(k.done, *ids)
        pipe.hdel(k.prompts, *ids)
        pipe.execute()
        marked += len(ids)
    r.hincrby(k.counters, "completed", marked)


def scale_case(cfg: Config, work: Path, prompts: int, done: int, bodies: str) -> dict:
    """Enqueue `prompts` prompts with `--bodies bodies` into a fresh Redis, probe status, mark
    `done` of them done and enqueue the dataset again (the resume)."""
    name = f"scale-{prompts}-{bodies}"
    root = work / name
    log(f"{name}: the {prompts:,}-prompt dataset (generated once, then cached)")
    t = time.monotonic()
    dataset = data.cached_dataset(prompts, CACHE)
    dataset_s = time.monotonic() - t
    size = dataset.stat().st_size
    enqueue = ["enqueue", "--dataset", str(dataset), "--job", "scale", "--gpus", str(cfg.servers),
               "--bodies", bodies]
    with LocalCluster(root / "logs", env={"DFLASH_OUTPUT_DIR": str(root / "output")}) as c:
        url = c.start_redis(free_port(), root / "redis")
        r = redis.Redis.from_url(url)
        empty = r.info("memory")["used_memory"]
        redis_pid = c.named["redis"].pid
        log(f"{name}: enqueue {prompts:,} prompts ({size / 2**30:.2f} GiB)")
        cpu0 = measure.cpu_seconds(redis_pid)
        t = time.monotonic()
        out = c.manage(*enqueue, capture=True)
        enqueue_s = time.monotonic() - t
        redis_cpu = measure.cpu_seconds(redis_pid) - cpu0
        total = int(r.hget(JobName("scale").counters, "total") or 0)
        memory = r.info("memory")["used_memory"] - empty
        chunks = sorted((root / "output" / "scale" / "prompts").glob("*.zst"))
        chunk_bytes = sum(p.stat().st_size for p in chunks)
        probe = json.loads(subprocess.run(
            [sys.executable, "-m", "benchmarks.probe", "--job", "scale"], cwd=ROOT, env=c.env,
            check=True, capture_output=True, text=True).stdout)
        log(f"{name}: marking {done:,} done, then enqueueing again (the resume)")
        mark_done(r, "scale", done, [c.gpu(i) for i in range(cfg.servers)])
        t = time.monotonic()
        again = c.manage(*enqueue, capture=True)
        resume_s = time.monotonic() - t
        after = {k.decode(): int(v) for k, v in r.hgetall(JobName("scale").counters).items()}
        pending_after = r.llen(JobName("scale").pending)
        memory_after = r.info("memory")["used_memory"] - empty
        chunks_after = len(list((root / "output" / "scale" / "prompts").glob("*.zst")))
        shutil.rmtree(root / "output", ignore_errors=True)  # gigabytes of chunks at 10M
    return {"prompts": prompts, "bodies": bodies, "dataset_bytes": size, "dataset_gen_s": dataset_s,
            "enqueue_s": enqueue_s, "stored": total, "redis_cpu_s": redis_cpu,
            "used_memory": memory, "bytes_per_prompt": memory / max(1, total), **probe,
            "chunks": len(chunks), "chunk_bytes": chunk_bytes,
            "chunks_after_resume": chunks_after,
            "resume_s": resume_s, "done_before_resume": done,
            "total_after_resume": after.get("total", 0), "pending_after_resume": pending_after,
            "used_memory_after_resume": memory_after,
            "enqueue_output": out.stdout[-2000:], "resume_output": again.stdout[-2000:]}


# -- case 6 -------------------------------------------------------------------------------------

class MemorySampler:
    """Redis's used_memory every `interval` seconds, in a thread: [(monotonic time, bytes)]."""

    def __init__(self, r: redis.Redis, interval: float = 0.5):
        self.r, self.interval = r, interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self.r.info("memory")["used_memory"]))
            self._stop.wait(self.interval)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, t0: float, t1: float) -> list[int]:
        return [m for t, m in self.samples if t0 <= t <= t1]


def outage_case(cfg: Config, work: Path, dataset: Path) -> dict:
    """Case 6: S3 (moto's server, behind a proxy that is cut) goes away for cfg.outage_s in the
    middle of a run, with the deployed batch size. Sealed batches go to beat's spool and leave
    Redis, so Redis's memory stays where it was; when S3 is back every batch goes up in order,
    and every prompt's row is in S3 exactly once."""
    from dflash_dev.s3 import AWS_ENV, BUCKET, MotoServer, TcpProxy
    from dflash_tasks.output.batches import read_batch, read_manifest
    from dflash_tasks.output.storage import S3Storage

    root = work / "outage"
    root.mkdir(parents=True, exist_ok=True)
    moto = MotoServer(root / "moto.log")
    moto.create_bucket()
    proxy = TcpProxy(moto.port).start()
    s3_env = {**AWS_ENV, "AWS_ENDPOINT_URL": proxy.url, "DFLASH_S3_URI": f"s3://{BUCKET}/runs",
              "DFLASH_OUTPUT_DIR": str(root / "output")}
    sim_args = ["--slots", str(cfg.slots), "--decode-tps", f"{cfg.outage_decode_tps:g}",
                "--fixed-tokens", str(cfg.outage_tokens)]
    job, n = "outage", cfg.outage_prompts
    try:
        with LocalCluster(root / "logs", env=s3_env) as c:
            c.start_redis(free_port(), root / "redis")
            c.start_servers(cfg.servers, sim_args)
            c.start_workers()
            c.start_beat()
            r = redis.Redis.from_url(c.env["DFLASH_REDIS_URL"])
            k = JobName(job)
            spool = root / "output" / ".spool" / job

            def completed() -> int:
                return int(r.hget(k.counters, "completed") or 0)

            log(f"case 6: {n:,} prompts of {cfg.outage_tokens} tokens; S3 cut for"
                f" {cfg.outage_s:.0f} s after {cfg.outage_warmup_s:.0f} s")
            with MemorySampler(r) as memory:
                c.manage("enqueue", "--dataset", str(dataset), "--job", job, "--gpus",
                         str(cfg.servers), "--limit", str(n), capture=True)
                started = time.monotonic()
                wait_until(lambda: time.monotonic() - started >= cfg.outage_warmup_s
                           and int(r.hget(k.counters, "batches") or 0) >= 1,
                           timeout=300, interval=0.2, what="a first batch in S3")
                proxy.stop()
                cut_at, done_at_cut = time.monotonic(), completed()
                wait_until(lambda: time.monotonic() - cut_at >= cfg.outage_s, timeout=cfg.outage_s + 5,
                           interval=0.5)
                restored_at, done_at_restore = time.monotonic(), completed()
                spooled_at_restore = len(list(spool.glob("*"))) if spool.exists() else 0
                proxy = TcpProxy(moto.port, port=proxy.port).start()
                wait_until(lambda: r.hget(k.config, "status") == b"done"
                           and not (spool.exists() and any(spool.glob("*"))),
                           timeout=600, interval=0.5, what="every row shipped after the outage")
                shipped_at = time.monotonic()
            storage = S3Storage(f"s3://{BUCKET}/runs")
            with _environ({**AWS_ENV, "AWS_ENDPOINT_URL": moto.url}):
                storage.client  # made with moto's endpoint, not the proxy's
                manifest = read_manifest(storage, job)
                rows = [row for rec in manifest["batches"] for row in read_batch(storage, rec)]
        ids = [row["id"] for row in rows]
        row_bytes = statistics.mean(len(json.dumps(row)) for row in rows)
        expected = {p.id for p in itertools.islice(read_prompts(dataset), n)}
    finally:
        proxy.stop()
        moto.stop()
    before = memory.between(cut_at - 5, cut_at)
    during = memory.between(cut_at, restored_at)
    half = memory.between((cut_at + restored_at) / 2, restored_at)
    return {"prompts": n, "outage_s": restored_at - cut_at,
            "rows_during_outage": done_at_restore - done_at_cut,
            "spooled_batches_at_restore": spooled_at_restore,
            "memory_before": max(before), "memory_peak_during": max(during),
            "memory_peak_second_half": max(half), "memory_end_of_outage": during[-1],
            "memory_series": [(round(t - cut_at, 1), m) for t, m in memory.samples],
            "shipped_after_restore_s": shipped_at - restored_at,
            "batches": len(manifest["batches"]), "rows_shipped": len(ids),
            "ids_doubled": len(ids) - len(set(ids)), "ids_missing": len(expected - set(ids)),
            "ids_unknown": len(set(ids) - expected), "batch_rows": Settings().batch_rows,
            "mean_row_bytes": row_bytes}


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# -- case 8 -------------------------------------------------------------------------------------

def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def many_gpus_case(cfg: Config, work: Path, dataset: Path, unit_times: list[float]) -> dict:
    """Case 8: cfg.many_nodes simulated nodes of cfg.many_gpus_per_node GPUs each (a LocalCluster
    per node, the GPUs named gpuI@nodeN as on real nodes), one Redis and one beat, one job over
    all of them. No baseline beside it: the machine has room for one such deployment."""
    root = work / "many"
    nodes = [f"node{i}" for i in range(cfg.many_nodes)]
    n_gpus = cfg.many_nodes * cfg.many_gpus_per_node
    sim_args = ["--slots", str(cfg.many_slots), "--decode-tps", f"{cfg.many_decode_tps:g}"]
    env = {"DFLASH_OUTPUT_DIR": str(root / "output")}
    clusters = [LocalCluster(root / "logs" / node, env=env, node=node) for node in nodes]
    with contextlib.ExitStack() as stack:
        for c in reversed(clusters):  # the first node, with Redis, stops last
            stack.enter_context(c)
        first = clusters[0]
        url = first.start_redis(free_port(), root / "redis")
        for c in clusters[1:]:
            c.env["DFLASH_REDIS_URL"] = url
        log(f"case 8: starting {n_gpus} simulated servers and GPU workers on {len(nodes)} nodes")
        t = time.monotonic()
        urls = [u for c in clusters for u in c.start_servers(cfg.many_gpus_per_node, sim_args)]
        for c in clusters:
            c.start_workers()
        first.start_beat()
        startup_s = time.monotonic() - t
        r = redis.Redis.from_url(url)
        k = JobName("many")
        pids = {f"{c.node}/{n}": p.pid for c in clusters for n, p in c.named.items()}
        log(f"case 8: {cfg.many_prompts:,} prompts over {n_gpus} GPUs (started in {startup_s:.0f} s)")
        with measure.ServerPoller(urls, interval=1.0) as poller:
            meter = measure.CpuMeter(pids).start()
            commands0 = r.info("stats")["total_commands_processed"]
            first.manage("enqueue", "--dataset", str(dataset), "--job", "many", "--gpus", "all",
                         "--max-output-tokens", str(cfg.max_tokens), capture=True)
            ideal = measure.ideal_makespan(unit_times, [cfg.many_slots] * n_gpus, [1.0] * n_gpus)
            wait_until(lambda: int(r.hget(k.counters, "completed") or 0) >= cfg.many_prompts / 2,
                       timeout=4 * ideal + 300, interval=0.5, what="half of case 8's prompts")
            probe = json.loads(subprocess.run(
                [sys.executable, "-m", "benchmarks.probe", "--job", "many", "--repeat", "5"],
                cwd=ROOT, env=first.env, check=True, capture_output=True, text=True).stdout)
            rss_busy = {n: rss_bytes(p) for n, p in pids.items()}
            wait_until(lambda: sum(int(r.hget(k.counters, f) or 0) for f in ("completed", "failed"))
                       >= cfg.many_prompts, timeout=4 * ideal + 300, interval=0.5,
                       what="case 8's run")
            commands = r.info("stats")["total_commands_processed"] - commands0
            meter.stop()
        counters = {key.decode(): int(v) for key, v in r.hgetall(k.counters).items()}
        rounds = measure.round_figures(r, cfg.many_decode_tps)
    fig = measure.figures(poller.series)
    completed = counters.get("completed", 0)
    memory: dict[str, dict] = {}
    for name, busy in rss_busy.items():
        m = memory.setdefault(measure.process_kind(name), {"processes": 0, "total": 0, "largest": 0})
        m["processes"] += 1
        m["total"] += busy
        m["largest"] = max(m["largest"], busy)
    cpu = meter.grouped()
    return {"nodes": len(nodes), "gpus": n_gpus, "slots": cfg.many_slots, "prompts": cfg.many_prompts,
            "startup_s": startup_s, "ideal_s": ideal, "longest_s": max(unit_times),
            **measure.references(unit_times, [cfg.many_slots] * n_gpus, [1.0] * n_gpus, ideal,
                                 **rounds),
            "ours": {**asdict(fig), "ratio": fig.makespan / ideal, "completed": completed,
                     "failed": counters.get("failed", 0), **measure.end_game_counters(counters),
                     "tokens_lost": sum(s.final["completion_tokens"] for s in poller.series)
                     - counters.get("output_tokens", 0)},
            "redis_commands_per_completion": commands / max(1, completed),
            "cpu_ms_per_completion": {kind: 1000 * v / max(1, completed) for kind, v in cpu.items()},
            "cpu_s": cpu, "wall_s": meter.wall, "memory": memory, **probe}


# -- main ---------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="Small sizes, for trying the harness.")
    ap.add_argument("--cases", default=DEFAULT_CASES, help="Which cases (3 comes with 1 and 2).")
    ap.add_argument("--decode-tps", type=float, help="Per-request decode speed of cases 1-3.")
    ap.add_argument("--prompts", type=int, help="Prompts in cases 1-3.")
    ap.add_argument("--concurrency", type=int, help="GPU workers' threads [manage.py worker's].")
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "RESULTS.md",
                    help="Where to write the table ('-' for nowhere).")
    ap.add_argument("--keep", action="store_true", help="Keep the work directory (logs, rows).")
    ap.add_argument("--render", type=Path, help="Only render a RESULTS.json written before.")
    args = ap.parse_args()
    if args.render:
        print(report.render(json.loads(args.render.read_text())))
        return
    cfg = Config.quick() if args.quick else Config()
    if args.decode_tps:
        cfg.decode_tps = args.decode_tps
    if args.prompts:
        cfg.prompts = args.prompts
    if args.concurrency:
        cfg.concurrency = args.concurrency
    cases = {c.strip() for c in args.cases.split(",")}
    if "9" in cases and cases != {"9"}:
        ap.error("case 9 (make bench-10m) runs alone: --cases 9")

    work = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    started = time.monotonic()
    results: dict = {"config": asdict(cfg), "machine": measure.machine_description(),
                     "date": time.strftime("%Y-%m-%d %H:%M %Z"), "quick": args.quick}
    try:
        if cases & {"1", "2", "3"}:
            dataset = data.cached_dataset(cfg.prompts, CACHE, seed=11)
            log("ideal: pricing every prompt with the simulated model")
            unit = measure.unit_service_times(dataset, cfg.max_tokens, cfg.decode_tps)
            results["makespan_dataset"] = {"prompts": len(unit), "mean_service_s": statistics.mean(unit),
                                           "offered_rate": cfg.servers * cfg.slots / statistics.mean(unit)}
            if cases & {"1", "3"}:
                results["case1"] = makespan_case(cfg, work, "case1", dataset, unit, [1.0] * cfg.servers)
            if cases & {"2", "3"}:
                slow = [1.0] * (cfg.servers - 1) + [cfg.slow_factor]
                results["case2"] = makespan_case(cfg, work, "case2", dataset, unit, slow)
        if "7" in cases:
            # The end game decides a short run: the same as case 2 with ~19 prompts per slot.
            end = replace(cfg, prompts=cfg.endgame_prompts)
            dataset = data.cached_dataset(end.prompts, CACHE, seed=19)
            unit = measure.unit_service_times(dataset, end.max_tokens, end.decode_tps)
            slow = [1.0] * (end.servers - 1) + [end.slow_factor]
            results["case7"] = makespan_case(end, work, "case7", dataset, unit, slow)
        if "8" in cases:
            dataset = data.cached_dataset(cfg.many_prompts, CACHE, seed=23)
            unit = measure.unit_service_times(dataset, cfg.max_tokens, cfg.many_decode_tps)
            results["case8"] = many_gpus_case(cfg, work, dataset, unit)
        if "4" in cases:
            small = data.cached_dataset(cfg.overhead_prompts, CACHE, seed=13)
            results["noop"] = noop_case(cfg, work)
            results["case4"] = overhead_case(cfg, work, small)
            results["case4_flower"] = overhead_case(cfg, work, small, flower=True)
        if "5" in cases:
            results["case5"] = scale_case(cfg, work, cfg.scale_prompts, cfg.scale_done, "redis")
            results["case5_storage"] = scale_case(cfg, work, cfg.scale_prompts, cfg.scale_done,
                                                  "storage")
        if "9" in cases:
            results["case9"] = scale_case(cfg, work, cfg.huge_prompts, cfg.huge_done, "storage")
        if "6" in cases:
            outage = data.cached_dataset(cfg.outage_prompts, CACHE, seed=17)
            results["case6"] = outage_case(cfg, work, outage)
        if "10" in cases:
            results["case10"] = seed_run.continuation_case(work, cfg.seed_prompts, cfg.servers)
        if "11" in cases:
            results["case11"] = seed_run.fleet_case(work)
        if "12" in cases:
            results["case12"] = seed_run.manifest_case(work, cfg.manifest_batches)
        if "13" in cases:
            results["case13"] = seed_run.continuation_round_case(work, cfg.round_prompts,
                                                                 cfg.servers, cfg.slow_factor)
        if "14" in cases:
            results["case14"] = seed_run.endgame_redis_case(work)
        if "15" in cases:
            results["case15"] = seed_run.colliding_ids_case(work)
        if "16" in cases:
            results["case16"] = conversations.multi_turn_case(work)
        if "17" in cases:
            results["case17"] = conversations.conversations_redis_case(work)
        if "18" in cases:
            dataset = data.cached_dataset(cfg.eta_prompts, CACHE, seed=29)
            results["case18"] = eta_run.eta_case(work, dataset, cfg.eta_prompts, cfg.servers,
                                                 cfg.slow_factor)
        if "19" in cases:
            results["case19"] = train_memory.memory_case()
    finally:
        results["bench_wall_s"] = time.monotonic() - started
        (work / "results.json").write_text(json.dumps(results, indent=1))
        if args.keep:
            log(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if cases == {"9"}:
        write_huge(args, results)
        return
    text = report.render(results)
    print(text)
    if str(args.results) != "-":
        old = args.results.read_text() if args.results.exists() else ""
        if (huge := report.kept_section(old)) is not None:
            text = report.with_section(text, huge)  # make bench-10m's own figures, kept
        args.results.write_text(text)
        args.results.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
        log(f"written to {args.results} (and its figures to {args.results.with_suffix('.json').name})")
        if not args.quick and cases >= set(DEFAULT_CASES.split(",")) and report.write_readme(README, results):
            log(f"and its table to {README}'s Performance section")


def write_huge(args, results: dict) -> None:
    """make bench-10m: its section of RESULTS.md and of the README, and RESULTS-10M.json."""
    section = report.huge_section(results)
    print(section)
    if str(args.results) == "-" or args.quick:
        return
    old = args.results.read_text() if args.results.exists() else ""
    args.results.write_text(report.with_section(old, section))
    figures = args.results.with_name(args.results.stem + "-10M.json")
    figures.write_text(json.dumps(results, indent=1) + "\n")
    README.write_text(report.with_section(README.read_text(), report.huge_section(results, readme=True)))
    log(f"written to {args.results}'s ten-million section, {figures.name} and {README}")


if __name__ == "__main__":
    main()
