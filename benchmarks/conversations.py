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


def conversations_redis_case(work: Path, gpus: int = 64, in_flight: int = 300, replies: int = 4,
                             reply_tokens: int = 1800) -> dict:
    """Case 17: what conversations between their replies hold in Redis at the seed's fleet. With
    each reply handed on to the front of pending, the conversations in progress are those in
    flight: `gpus` x `in_flight` of them, each here with `replies` replies made of
    `reply_tokens` random ids (which compress like real ones: not at all) and their text, handed
    on by the worker's own code (generate.py's entry_frame and store_entry, next_round.lua).
    Measured for a job whose prompts' texts wait in Redis (the entries inline) and one of
    `--bodies storage` (a chunk each on the output storage, Redis a reference)."""
    import hashlib
    import random

    from dflash_tasks.core import jobs
    from dflash_tasks.core.conversation import SLOT
    from dflash_tasks.core.settings import Settings
    from dflash_tasks.dispatch import window
    from dflash_tasks.ledger import Ledger
    from dflash_tasks.ledger.messages import encode_messages
    from dflash_tasks.tasks.generate import entry_frame, store_entry

    root = work / "case17"
    n = gpus * in_flight
    rng = random.Random(17)
    vocabulary = [f"{w}{i}" for i, w in enumerate("the proof follows since each term bounds an "
                                                   "integral so consider we have".split() * 50)]

    def text(words: int) -> str:
        return " ".join(rng.choice(vocabulary) for _ in range(words))

    script = [{"role": "system", "content": text(20)}]
    for t in range(replies + 1):
        script += [SLOT] if t else []
        script.append({"role": "user", "content": text(60)})
    context = 300
    turns = []
    for t in range(replies):
        context += 80 + reply_tokens // 4
        turns.append({"content": text(reply_tokens // 5), "reasoning_content": text(reply_tokens // 2),
                      "finish_reason": "stop", "prompt_tokens": context,
                      "completion_tokens": reply_tokens, "reasoning_tokens": reply_tokens * 3 // 4,
                      "gpu": "gpu0@node0", "latency_s": 40.0, "attempts": 1,
                      "token_ids": {"prompt": [rng.randrange(151643) for _ in range(context)],
                                    "response": [rng.randrange(151643) for _ in range(reply_tokens)]}})
    frames = [entry_frame(script, None, None, turns)]
    out: dict = {"gpus": gpus, "in_flight": in_flight, "conversations": n, "replies": replies,
                 "reply_tokens": reply_tokens, "entry_bytes": len(frames[0])}
    for bodies in ("redis", "storage"):
        job = JobName(f"turns-{bodies}")
        with LocalCluster(root / bodies / "logs", env={}) as c:
            r = redis.Redis.from_url(c.start_redis(free_port(), root / bodies / "redis"))
            s = Settings(output_dir=root / bodies / "output")
            jobs.save(r, job, jobs.GenerationParams(), selection=jobs.GpuSelection(), dataset="x",
                      turns="all")
            if bodies == "storage":
                jobs.body_location(r, job, wanted=str(root / bodies / "output"))
            gpu = "gpu0@node0"
            Ledger(r).add_prompts(job, [(f"c{i:06d}", encode_messages(script)) for i in range(n)])
            r.zadd(job.inflight(gpu), {f"c{i:06d}": 1 for i in range(n)})
            before = int(r.info("memory")["used_memory"])
            log(f"case 17: {n:,} conversations of {replies} replies handed on, bodies in {bodies}")
            started = time.monotonic()
            for i in range(n):
                prompt_id = f"c{i:06d}"
                started_from = hashlib.sha1(r.hget(job.prompts, prompt_id)).hexdigest()
                kept = store_entry(r, s, job, frames[0])
                assert window.next_round(r, job, prompt_id, gpu, kept, reply_tokens, started_from,
                                         turn=True, front=True)
            took = time.monotonic() - started
            after = int(r.info("memory")["used_memory"])
            out[bodies] = {"redis_growth_bytes": after - before,
                           "prompts_hash_bytes": int(r.memory_usage(job.prompts, samples=0)),
                           "hand_on_ms": 1000 * took / n}
    return out
