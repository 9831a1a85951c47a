"""`make bench`: the orchestration's performance, measured beside baselines in one run.

Real redis-server, real Celery workers and simulated SGLang servers (decode slots, per-request
decode speed, the real run's output-length distribution), all started here as processes.

1. makespan / ideal, 4 equal servers x 40 slots, 16,000 prompts      goal <= 1.03
2. makespan / ideal, the same with one server 1.5x slower             goal <= 1.05
3. slot occupancy, first request to the point the pending work runs out  goal >= 0.98
4. completions/s with servers that answer at once, beside a worker
   draining no-op Celery tasks                                        goal >= 400/s
5. enqueue of 1,000,000 prompts: time, Redis memory, status/progress latency, resume

Cases 1-3 run the project and the baseline (benchmarks/baseline.py: one asyncio process, a static
round-robin split, a semaphore per server) at the same time, each on its own four servers, so both
see the same machine. The table goes to stdout and to benchmarks/RESULTS.md.

    .venv/bin/python -m benchmarks [--quick] [--cases 1,2,4,5] [--results PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import data, measure, report  # noqa: E402
from dflash_dev.local import LocalCluster, free_port, wait_until  # noqa: E402
from dflash_tasks.core.keys import JobKeys, queue_for  # noqa: E402

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
    scale_prompts: int = 1_000_000   # case 5
    scale_done: int = 990_000

    @classmethod
    def quick(cls) -> "Config":
        return cls(prompts=2_000, decode_tps=2500.0, overhead_prompts=3_000, noop_tasks=3_000,
                   scale_prompts=100_000, scale_done=99_000)


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
        counters = JobKeys("bench").counters
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
    (root / "server-samples.json").write_text(json.dumps(
        {s.url: {"samples": s.samples, "final": s.final} for s in poller.series}))
    n = cfg.servers
    ideal = measure.ideal_makespan(unit_times, [cfg.slots] * n, slow)
    ours_fig = measure.figures(poller.series[:n])
    base_fig = measure.figures(poller.series[n:])
    return {
        "name": name, "slow": slow, "ideal_s": ideal, "work_s": sum(unit_times),
        "dynamic_ref": measure.dynamic_makespan(unit_times, [cfg.slots] * n, slow) / ideal,
        "static_ref": measure.static_makespan(unit_times, [cfg.slots] * n, slow) / ideal,
        "longest_s": max(unit_times), "wall_s": meter.wall,
        "ours": {**asdict(ours_fig), "ratio": ours_fig.makespan / ideal,
                 "completed": c.get("completed", 0), "failed": c.get("failed", 0)},
        "baseline": {**asdict(base_fig), "ratio": base_fig.makespan / ideal,
                     "completed": baseline["completed"], "failed": baseline["failed"],
                     "client_cpu_s": baseline.get("cpu_s", 0.0)},
        "cpu_s": meter.grouped(), "machine_cpu_s": machine,
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


def overhead_case(cfg: Config, work: Path, dataset: Path) -> dict:
    root = work / "overhead"
    sim_args = ["--slots", str(cfg.slots), "--decode-tps", "1e9", "--prefill-tps", "1e12",
                "--fixed-tokens", str(cfg.overhead_tokens)]
    with LocalCluster(root / "logs", env={"DFLASH_OUTPUT_DIR": str(root / "output")}) as c:
        c.start_redis(free_port(), root / "redis")
        c.start_servers(cfg.servers, sim_args)
        c.start_workers()
        c.start_beat()
        r = redis.Redis.from_url(c.env["DFLASH_REDIS_URL"])
        k = JobKeys("overhead")
        log(f"case 4: {cfg.overhead_prompts:,} prompts on servers that answer at once")
        meter = measure.CpuMeter({n: p.pid for n, p in c.named.items()}).start()
        started = time.monotonic()
        c.manage("enqueue", "--dataset", str(dataset), "--job", "overhead", "--gpus",
                 str(cfg.servers), "--limit", str(cfg.overhead_prompts), capture=True)
        samples: list[tuple[float, int]] = []
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            done = int(r.hget(k.counters, "completed") or 0)
            samples.append((time.monotonic(), done))
            if done >= cfg.overhead_prompts:
                break
            time.sleep(0.1)
        completed_at = time.monotonic()
        meter.stop()
        wait_until(lambda: r.hget(k.config, "status") == b"done", timeout=120, interval=0.2,
                   what="the last rows sealed")
        sealed_at = time.monotonic()
        batches = int(r.hget(k.counters, "batches") or 0)
    n = cfg.overhead_prompts
    return {"prompts": n, "rate": _rate(samples, n),
            "rate_incl_startup": n / (completed_at - started),
            "sealed_after_s": sealed_at - started, "batches": batches,
            "cpu_ms_per_completion": {g: 1000 * v / n for g, v in meter.grouped().items()}}


# -- case 5 -------------------------------------------------------------------------------------

def mark_done(r: redis.Redis, job: str, n: int, gpus: list[str]) -> None:
    """Put the job in the state it has after n completions (rows sealed and gone): the first n
    prompts (the dispatched ones first) in `done`, out of `prompts`/`pending`/in-flight, counted,
    and the GPU queues drained."""
    k = JobKeys(job)
    marked = 0
    for gpu in gpus:
        ids = [m for m, _ in r.zpopmin(k.inflight(gpu), 100_000)]
        if ids:
            r.sadd(k.done, *ids)
            r.hdel(k.prompts, *ids)
            marked += len(ids)
        r.delete(queue_for(gpu))
    while marked < n:
        ids = r.lpop(k.pending, min(10_000, n - marked))
        pipe = r.pipeline(transaction=False)
        pipe.sadd(k.done, *ids)
        pipe.hdel(k.prompts, *ids)
        pipe.execute()
        marked += len(ids)
    r.hincrby(k.counters, "completed", marked)


def scale_case(cfg: Config, work: Path) -> dict:
    root = work / "scale"
    log(f"case 5: the {cfg.scale_prompts:,}-prompt dataset (generated once, then cached)")
    t = time.monotonic()
    dataset = data.cached_dataset(cfg.scale_prompts, CACHE)
    dataset_s = time.monotonic() - t
    size = dataset.stat().st_size
    with LocalCluster(root / "logs", env={"DFLASH_OUTPUT_DIR": str(root / "output")}) as c:
        url = c.start_redis(free_port(), root / "redis")
        r = redis.Redis.from_url(url)
        empty = r.info("memory")["used_memory"]
        redis_pid = c.named["redis"].pid
        log(f"case 5: enqueue {cfg.scale_prompts:,} prompts ({size / 2**30:.2f} GiB)")
        cpu0 = measure.cpu_seconds(redis_pid)
        t = time.monotonic()
        out = c.manage("enqueue", "--dataset", str(dataset), "--job", "scale", "--gpus",
                       str(cfg.servers), capture=True)
        enqueue_s = time.monotonic() - t
        redis_cpu = measure.cpu_seconds(redis_pid) - cpu0
        total = int(r.hget(JobKeys("scale").counters, "total") or 0)
        memory = r.info("memory")["used_memory"] - empty
        probe = json.loads(subprocess.run(
            [sys.executable, "-m", "benchmarks.probe", "--job", "scale"], cwd=ROOT, env=c.env,
            check=True, capture_output=True, text=True).stdout)
        log(f"case 5: marking {cfg.scale_done:,} done, then enqueueing again (the resume)")
        mark_done(r, "scale", cfg.scale_done, [c.gpu(i) for i in range(cfg.servers)])
        t = time.monotonic()
        again = c.manage("enqueue", "--dataset", str(dataset), "--job", "scale", "--gpus",
                         str(cfg.servers), capture=True)
        resume_s = time.monotonic() - t
        after = {k.decode(): int(v) for k, v in r.hgetall(JobKeys("scale").counters).items()}
        pending_after = r.llen(JobKeys("scale").pending)
        memory_after = r.info("memory")["used_memory"] - empty
    return {"prompts": cfg.scale_prompts, "dataset_bytes": size, "dataset_gen_s": dataset_s,
            "enqueue_s": enqueue_s, "stored": total, "redis_cpu_s": redis_cpu,
            "used_memory": memory, "bytes_per_prompt": memory / max(1, total), **probe,
            "resume_s": resume_s, "done_before_resume": cfg.scale_done,
            "total_after_resume": after.get("total", 0), "pending_after_resume": pending_after,
            "used_memory_after_resume": memory_after,
            "enqueue_output": out.stdout[-2000:], "resume_output": again.stdout[-2000:]}


# -- main ---------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="Small sizes, for trying the harness.")
    ap.add_argument("--cases", default="1,2,4,5", help="Which cases (3 comes with 1 and 2).")
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
        if "4" in cases:
            small = data.cached_dataset(cfg.overhead_prompts, CACHE, seed=13)
            results["noop"] = noop_case(cfg, work)
            results["case4"] = overhead_case(cfg, work, small)
        if "5" in cases:
            results["case5"] = scale_case(cfg, work)
    finally:
        results["bench_wall_s"] = time.monotonic() - started
        (work / "results.json").write_text(json.dumps(results, indent=1))
        if args.keep:
            log(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    text = report.render(results)
    print(text)
    if str(args.results) != "-":
        args.results.write_text(text)
        args.results.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
        log(f"written to {args.results} (and its figures to {args.results.with_suffix('.json').name})")


if __name__ == "__main__":
    main()
