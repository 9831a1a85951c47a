"""The Slurm recipe (workers/slurm/dflash.sbatch, docs/CLUSTER.md) submitted as written to a real
Slurm of two nodes of two GPUs each (slurm_support.py), with the simulated servers: Redis and beat
on the first node, launch_node.py on both through srun, each node named by Slurm and given its
GPUs by the allocation. One node's step is scancelled mid-run and the allocation is then
requeued, as a preemption does; every prompt is done once, with rows from both nodes."""
from __future__ import annotations

import os
from collections import Counter

import pytest
import redis
from conftest import write_jsonl
from failure_support import sim_hold
from slurm_support import Slurm, missing
from support import ROOT, free_port, wait_until

from dflash_dev.local import free_port_run
from dflash_tasks.core.keys import JobName
from dflash_tasks.output.batches import read_batch, read_manifest
from dflash_tasks.output.storage import LocalStorage

SCRIPT = ROOT / "workers" / "slurm" / "dflash.sbatch"

pytestmark = pytest.mark.skipif(bool(missing()) or os.geteuid() != 0,
                                reason=f"needs Slurm and munge ({', '.join(missing())} missing: "
                                       ".ci/run installs them) and root, as CI runs")


@pytest.fixture
def slurm(tmp_path):
    cluster = Slurm(tmp_path / "slurm").start()
    yield cluster
    cluster.stop()


def test_the_sbatch_script_runs_a_job_on_two_nodes_through_a_step_cancelled_and_a_requeue(
        slurm, tmp_path):
    prompts = [{"id": f"s{i:04d}", "prompt": f"Question {i}: what of {i * 7919 % 1000}?"}
               for i in range(300)]
    dataset = write_jsonl(tmp_path / "prompts.jsonl", prompts)
    # node i's servers on BASE + 100 i + GPU: all 102 ports free
    run_dir, base, redis_port = tmp_path / "run", free_port_run(102), free_port()
    env = {"JOB": "slurm", "DATASET": str(dataset), "RUN_DIR": str(run_dir),
           "NODE_ARGS": '--simulate --sim-args "--slots 8 --decode-tps 150 --median-tokens 300"',
           "ENQUEUE_ARGS": "--max-output-tokens 2048", "BASE_PORT": str(base),
           # Loopback only: the test's Redis listens and is reached on 127.0.0.1
           "REDIS_HOST": "127.0.0.1", "REDIS_BIND": "127.0.0.1", "REDIS_PORT": str(redis_port),
           "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}",
           "DFLASH_BATCH_ROWS": "50", "DFLASH_BATCH_MAX_AGE_S": "2", "HF_HUB_OFFLINE": "1"}
    job = slurm.run("sbatch", "--parsable", "--nodes=2", "--gpus-per-node=2", "--time=30",
                    str(SCRIPT), env=env, cwd=tmp_path).stdout.strip()
    urls = [f"http://127.0.0.1:{base + offset}" for offset in (0, 1, 100, 101)]

    def book() -> redis.Redis:
        password = (run_dir / "redis" / "password").read_text().strip()
        return redis.Redis(host="127.0.0.1", port=redis_port, password=password)

    def counters() -> dict[str, int]:
        try:
            raw = book().hgetall(JobName("slurm").counters)
        except (redis.ConnectionError, FileNotFoundError):
            return {}
        return {k.decode(): int(v) for k, v in raw.items()}

    def log() -> str:
        return "\n".join(p.read_text(errors="replace") for p in
                         [tmp_path / f"dflash-{job}.log", *sorted((run_dir / "logs").glob("*.log"))]
                         if p.exists())[-6000:]

    wait_until(lambda: counters().get("completed", 0) >= 60 and len(slurm.steps(job)) == 2,
               timeout=240, interval=1, what=f"60 rows from the allocation: {log()}")
    # Held mid-run: the step is cancelled while generations are in flight on every GPU.
    sim_hold(*urls)
    steps = slurm.steps(job)
    slurm.run("scancel", steps["n2"])
    wait_until(lambda: "n2" not in slurm.steps(job), timeout=60, what="n2's step to end")
    # Preempted: the allocation is requeued, everything in it stopped, and started again.
    slurm.run("scontrol", "requeue", job)
    wait_until(lambda: slurm.job_state(job) == "PENDING", timeout=90, interval=0.5,
               what="the allocation requeued")
    slurm.run("scontrol", "update", f"jobid={job}", "StartTime=now")  # no wait before its rerun
    def done() -> tuple[dict[str, int], set[str]] | None:
        """The books and the registered GPUs, read once the job is done (the allocation then
        stops Redis with everything else)."""
        if (book().hget(JobName("slurm").config, "status") or b"") != b"done":
            return None
        return counters(), {k.decode() for k in book().hkeys("dflash:workers")}

    books, registered = wait_until(done, timeout=600, interval=0.5,
                                   what=f"the job done after the requeue: {log()}")
    wait_until(lambda: slurm.job_state(job) == "", timeout=120, interval=1,
               what="the allocation to end by itself once the job is done")

    storage = LocalStorage(run_dir / "output")
    rows = [row for rec in read_manifest(storage, "slurm")["batches"]
            for row in read_batch(storage, rec)]
    ids = Counter(row["id"] for row in rows)
    assert set(ids) == {p["id"] for p in prompts} and max(ids.values()) == 1
    nodes = Counter(row["metadata"]["gpu"].split("@")[1] for row in rows)
    assert set(nodes) == {"n1", "n2"}, nodes
    assert books["completed"] == len(rows) == books["total"]
    assert books["output_tokens"] == sum(r["metadata"]["completion_tokens"] for r in rows)
    text = (tmp_path / f"dflash-{job}.log").read_text()
    assert "restart 1" in text and text.count("job slurm: done") == 1, text[-3000:]
    # The GPUs came from the allocation, named by Slurm's nodes.
    assert registered == {"gpu0@n1", "gpu1@n1", "gpu0@n2", "gpu1@n2"}, registered
