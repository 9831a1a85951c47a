"""Several nodes against one Redis, each started as an operator would: `launch_node.py --node NAME
--simulate`, its GPUs named gpuI@NAME (the same local indices on every node, different ports on
this one machine). One job on every registered GPU: a node that joins mid-run takes work within
seconds, a node warm-stopped mid-run hands its prompts to the others, and every row is there
exactly once. Deployed dispatch settings throughout (the maintain period, the gone-worker grace,
the windows); only the batching and retry waits are the tests' shorter ones (conftest.Cluster)."""
from __future__ import annotations

import signal

from conftest import Cluster, write_jsonl
from failure_support import check_books, sim_hold, sim_release
from support import python, wait_until

from dflash_dev.local import free_port_run
from dflash_tasks.core.keys import WORKERS

# 1 s per request (100 tokens at 100 tokens/s), 4 slots: 4 completions/s per GPU, so 900 prompts
# keep four GPUs busy for about a minute, long enough for a node to join and another to leave.
SIM_ARGS = "--slots 4 --decode-tps 100 --fixed-tokens 100"
PROMPTS = 900


def launch(c: Cluster, node: str, gpus: str):
    """A node's launcher, stopped with the cluster (its SIGTERM stops its workers first), and the
    URLs of its simulated servers."""
    base = free_port_run(len(gpus.split(",")))
    urls = [f"http://127.0.0.1:{base + int(i)}" for i in gpus.split(",")]
    return urls, c.spawn(f"node-{node}", python(
        "workers/launch_node.py", "--node", node, "--gpus", gpus, "--simulate",
        "--sim-args", SIM_ARGS, "--max-running-requests", "4", "--base-port", str(base),
        "--log-dir", str(c.logs / f"node-{node}"), "--health-interval", "1"))


def registered(c: Cluster, *gpus: str) -> bool:
    return all(c.r.hexists(WORKERS, g) for g in gpus)


def test_two_nodes_share_a_job_a_third_joins_and_one_leaves(tmp_path, redis_url):
    c = Cluster(tmp_path, redis_url)
    try:
        first = ["gpu0@a", "gpu1@a", "gpu0@b", "gpu1@b"]
        servers_a, _ = launch(c, "a", "0,1")
        _, node_b = launch(c, "b", "0,1")
        wait_until(lambda: registered(c, *first), timeout=120, what="nodes a and b to register")
        c.start_beat()
        rows = [{"id": f"n{i:04d}", "prompt": f"Count to {i}."} for i in range(PROMPTS)]
        out = c.manage("enqueue", "--dataset", str(write_jsonl(tmp_path / "d.jsonl", rows)),
                       "--job", "nodes", "--max-output-tokens", "512").stdout
        assert "every GPU of every node: 4 with a live worker now" in out, out

        # While the backlog lasts, every GPU of both nodes has work (in flight or queued for it).
        def busy_until(completed: int) -> dict:
            def check():
                snap = c.status("nodes")
                if snap["pending"] > 0:
                    idle = [g for g in first if snap["gpus"][g]["in_flight"] == 0]
                    assert not idle, f"idle with {snap['pending']} pending: {idle}"
                return snap["completed"] >= completed and snap
            return wait_until(check, timeout=180, interval=0.5, what=f"{completed} completions")

        busy_until(120)
        servers_c, _ = launch(c, "c", "0")  # node c joins the running job: no re-enqueue
        wait_until(lambda: c.status("nodes")["gpus"].get("gpu0@c", {}).get("completed", 0) > 0,
                   timeout=60, what="node c's GPU to complete prompts")

        busy_until(300)
        # The other nodes' servers held (they answer nothing more) while node b leaves, so the
        # run is mid-way when it does, on a fast machine or a slow one.
        sim_hold(*servers_a, *servers_c)
        node_b.popen.send_signal(signal.SIGTERM)  # node b leaves: a warm stop
        assert node_b.popen.wait(timeout=120) == 0, node_b.log()[-3000:]
        left = c.status("nodes")
        assert left["pending"] + left["in_flight"] > 0  # work was left to hand over
        sim_release(*servers_a, *servers_c)

        final = c.wait_done("nodes", timeout=300)
        check_books(c, "nodes", {r["id"] for r in rows})
        assert {g for g, v in final["gpus"].items() if v["completed"]} == {*first, "gpu0@c"}
        for gpu in ("gpu0@b", "gpu1@b"):
            assert c.r.zcard(f"dflash:{{nodes}}:inflight:{gpu}") == 0
            assert final["gpus"][gpu]["alive"] is False
        assert set(final["nodes"]) == {"a", "b", "c"}
        assert sum(n["completed"] for n in final["nodes"].values()) == PROMPTS
        assert final["nodes"]["a"]["gpus"] == 2 and final["nodes"]["c"]["gpus"] == 1
        assert "its worker stopped" in c.beat.log()  # b's window went back to pending at once
    finally:
        c.stop()
