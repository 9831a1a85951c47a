"""Case 16 of `make bench`: a job of conversations whose every reply is generated (`enqueue
--turns all`) against a single-turn job of exactly the same token work.

The multi-turn job runs first: `conversations` conversations of `turns` user turns each, every
reply generated after the target's own earlier ones. The single-turn job is then made from its
rows: each reply's context (the conversation up to it, the earlier replies' content) as a prompt
of its own, enqueued with `--turns last`. The simulated server renders those prompts to the same
ids and so generates the same replies: the same requests, the same prompt and output tokens (the
case checks it), only free of the wait of each reply on the last. Both run on fresh servers and
workers of the same shape. The figure is the throughput (output tokens over the makespan, the
first request to the last answer) of the multi-turn job against the single-turn one's; turns of
different conversations keep every slot full, so they stay within 10%.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import redis

from dflash_dev.local import LocalCluster, free_port, wait_until
from dflash_tasks.core.conversation import reply_rows
from dflash_tasks.core.keys import JobName
from dflash_tasks.output.batches import read_batch, read_manifest
from dflash_tasks.output.storage import LocalStorage

GOAL = 0.90  # the multi-turn job's throughput, at least this share of the single-turn one's


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def conversation_dataset(path: Path, conversations: int, turns: int) -> Path:
    """ShareGPT-style conversations whose assistant turns another model wrote."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(conversations):
            conv = [{"from": "system", "value": f"You are assistant {i % 7}."}]
            for t in range(turns):
                conv += [{"from": "human", "value": f"Conversation {i}, question {t}: what of "
                                                    f"{i * 7919 % 4099 + t}?"},
                         {"from": "gpt", "value": f"Another model's answer {t}."}]
            f.write(json.dumps({"id": f"c{i:05d}", "conversations": conv}) + "\n")
    return path


def _run(root: Path, dataset: Path, job: JobName, sim_args: list[str], servers: int,
         enqueue: list[str]) -> tuple[dict, list[dict], dict]:
    """One job on fresh servers, workers and beat: its figures, rows and counters."""
    from benchmarks import measure

    with LocalCluster(root / "logs", env={"DFLASH_OUTPUT_DIR": str(root / "output")}) as c:
        r = redis.Redis.from_url(c.start_redis(free_port(), root / "redis"))
        urls = c.start_servers(servers, sim_args)
        c.start_workers()
        c.start_beat()
        with measure.ServerPoller(urls) as poller:
            c.manage("enqueue", "--dataset", str(dataset), "--job", job, *enqueue, capture=True)
            wait_until(lambda: r.hget(job.config, "status") == b"done", timeout=1800,
                       interval=0.5, what=f"job {job}")
        counters = {k.decode(): int(v) for k, v in r.hgetall(job.counters).items()}
        storage = LocalStorage(root / "output")
        rows = [row for rec in read_manifest(storage, job)["batches"]
                for row in read_batch(storage, rec)]
    poller.save(root / "server-samples.json")
    fig = measure.figures(poller.series)
    generated = sum(s.final["completion_tokens"] for s in poller.series)
    return {"makespan_s": fig.makespan, "occupancy": fig.occupancy, "requests": fig.requests,
            "output_tokens": generated,
            "output_tokens_per_s": generated / fig.makespan}, rows, counters


def multi_turn_case(work: Path, conversations: int = 400, turns: int = 5,
                    servers: int = 2) -> dict:
    root = work / "case16"
    slots, tps, cap = 40, 600.0, 4096
    sim_args = ["--slots", str(slots), "--decode-tps", f"{tps:g}", "--median-tokens", "500",
                "--p-over-4096", "0.01"]
    dataset = conversation_dataset(root / "conversations.jsonl", conversations, turns)
    log(f"case 16: {conversations:,} conversations of {turns} turns, every reply generated")
    multi, rows, counters = _run(root / "multi", dataset, JobName("turns"), sim_args, servers,
                                 ["--turns", "all", "--max-output-tokens", str(cap)])
    # The same work, one prompt per reply: its context as the dataset's conversation.
    single_set = root / "replies.jsonl"
    with open(single_set, "w") as f:
        for row in rows:
            for reply in reply_rows(row):
                f.write(json.dumps({"id": reply["id"],
                                    "conversations": reply["conversations"][:-1]}) + "\n")
    replies = sum(len(row["metadata"]["turns"]) for row in rows)
    log(f"case 16: the same {replies:,} replies as single-turn prompts")
    single, single_rows, _ = _run(root / "single", single_set, JobName("replies"), sim_args,
                                  servers, ["--max-output-tokens", str(cap)])
    same = sum(r["metadata"]["completion_tokens"] for r in rows) == \
        sum(r["metadata"]["completion_tokens"] for r in single_rows)
    ratio = multi["output_tokens_per_s"] / single["output_tokens_per_s"]
    return {"conversations": conversations, "turns": turns, "replies": replies,
            "servers": servers, "slots": slots, "decode_tps": tps, "multi": multi,
            "single": single, "same_work": same, "throughput_ratio": ratio, "goal": GOAL,
            "met": same and ratio >= GOAL, "handed_on": counters.get("turns", 0),
            "rounds": counters.get("rounds", 0)}
