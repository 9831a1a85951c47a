"""The pipeline's makespan beside the ideal: N prompts on two simulated servers with 40 decode
slots each, two pinned workers and beat, all real processes on this machine.

    .venv/bin/python benchmarks/pipeline_makespan.py [--prompts 2000] [--decode-tps 2000]

Ideal = max(total simulated service time / total slots, the longest single request), computed
from the simulated server's own length model for exactly these prompts. Makespan = from the first
request any server received to the last one it finished, read from the servers' /sim/stats.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_dev.local import LocalCluster, free_port, wait_until  # noqa: E402
from dflash_dev.sim.lengths import chat_plan, ideal_makespan, service_seconds  # noqa: E402

SLOTS, GPUS, MAX_TOKENS = 40, 2, 8192


def prompts(n: int) -> list[dict]:
    return [{"id": f"p{i:06d}", "prompt": f"Question {i}: explain idea number {i * 7919 % 10007}."}
            for i in range(n)]


def ideal_s(rows: list[dict], decode_tps: float) -> tuple[float, float]:
    times = []
    for row in rows:
        plan = chat_plan([{"role": "user", "content": row["prompt"]}], MAX_TOKENS)
        times.append(service_seconds(plan.prompt_tokens, plan.completion_tokens, decode_tps=decode_tps))
    return ideal_makespan(times, SLOTS * GPUS), sum(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--decode-tps", type=float, default=2000.0)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="dflash-makespan-"))
    rows = prompts(args.prompts)
    dataset = work / "prompts.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ideal, total_service = ideal_s(rows, args.decode_tps)

    with LocalCluster(work / "logs", env={"DFLASH_OUTPUT_DIR": str(work / "output")}) as c:
        c.start_redis(free_port(), work / "redis", appendonly=False)
        urls = c.start_servers(GPUS, ["--slots", str(SLOTS), "--decode-tps", str(args.decode_tps)])
        c.start_workers()
        c.start_beat()
        started = time.time()
        c.manage("enqueue", "--dataset", str(dataset), "--job", "makespan", "--gpus", str(GPUS),
                 "--max-output-tokens", str(MAX_TOKENS), capture=True)
        snap = wait_until(lambda: (
            s := json.loads(c.manage("status", "--job", "makespan", "--json", capture=True).stdout)
        )["status"] == "done" and s, timeout=3600, interval=1.0, what="the job to finish")
        stats = [httpx.get(url + "/sim/stats").json() for url in urls]

    first = min(s["first_request_at"] for s in stats)
    last = max(s["last_finished_at"] for s in stats)
    makespan = last - first
    busy = sum(s["service_seconds_sum"] for s in stats)
    print(f"prompts                 {args.prompts:,} ({snap['completed']:,} completed, {snap['failed']} failed)")
    print(f"servers x slots         {GPUS} x {SLOTS}, decode {args.decode_tps:g} tokens/s per request")
    print(f"total service time      {total_service:,.1f} s (servers counted {busy:,.1f} s)")
    print(f"ideal makespan          {ideal:,.1f} s")
    print(f"measured makespan       {makespan:,.1f} s  (first request to last answer)")
    print(f"makespan / ideal        {makespan / ideal:.3f}")
    print(f"enqueue to done         {time.time() - started:,.1f} s (includes sealing the last batch)")
    print(f"logs                    {work / 'logs'}")


if __name__ == "__main__":
    main()
