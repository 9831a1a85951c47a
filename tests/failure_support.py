"""Helpers shared by the failure tests: datasets, the simulated server's control endpoints, raw
queue entries, and the exactly-once check that allows for a failed registry."""
from __future__ import annotations

import base64
import json
import pickle
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
from conftest import write_jsonl


def prompts(n: int, prefix: str = "p") -> list[dict]:
    return [{"id": f"{prefix}{i:05d}", "prompt": f"Question {i}: explain idea number {i * 7919 % 1000}."}
            for i in range(n)]


def dataset(tmp_path: Path, rows: list, name: str = "prompts.jsonl") -> Path:
    return write_jsonl(tmp_path / name, rows)


def sim_stats(url: str) -> dict:
    return httpx.get(f"{url}/sim/stats", timeout=10).json()


def sim_hold(*urls: str, after: int = 0) -> None:
    """Hold every answer of these simulated servers (/sim/hold): the run stops where it is, on a
    fast machine or a slow one, until sim_release; with `after`, once each has given that many
    more answers."""
    for url in urls:
        httpx.post(f"{url}/sim/hold", json={"after": after}, timeout=10).raise_for_status()


def sim_release(*urls: str) -> None:
    for url in urls:
        httpx.post(f"{url}/sim/release", timeout=10).raise_for_status()


def messages_settled(c, job: str, gpu: str) -> bool:
    """Every prompt of `job` in flight on `gpu` has its message in the GPU's queue or among the
    broker's unacknowledged ones, on two looks a moment apart: with the server held, no worker
    is between its BRPOP and its unacknowledged record, where a SIGKILL loses the message (the
    reaper's lost_message_grace_s brings such a one back; a test of the restart path must not
    wait for it)."""
    from dflash_tasks.core.keys import GpuName, JobName
    from dflash_tasks.dispatch import UnackedLook, messages_present

    name, queue = JobName(job), GpuName(gpu)
    for look in range(2):
        in_flight = {m.decode() for m in c.r.zrange(name.inflight(queue), 0, -1)}
        if in_flight - messages_present(c.r, name, queue, UnackedLook(c.r).ids()):
            return False
        if look == 0:
            time.sleep(0.5)
    return True


def sim_down(url: str, seconds: float) -> None:
    httpx.post(f"{url}/sim/down", json={"seconds": seconds}, timeout=10).raise_for_status()


def counters(c, job: str) -> dict[str, int]:
    raw = c.r.hgetall(f"dflash:{{{job}}}:counters")
    return {k.decode(): int(v) for k, v in raw.items()}


def failed_registry(c, job: str) -> dict[str, dict]:
    raw = c.r.hgetall(f"dflash:{{{job}}}:failed")
    return {k.decode(): json.loads(v) for k, v in raw.items()}


def check_books(c, job: str, ok_ids: set[str], failed_ids: set[str] = frozenset()) -> list[dict]:
    """Every id in ok_ids in exactly one row, every id in failed_ids in the registry, and the
    counters equal to what the output holds."""
    rows = c.rows(job)
    ids = [row["id"] for row in rows]
    doubled = [i for i, n in Counter(ids).items() if n > 1]
    assert not doubled, f"ids in two rows: {doubled[:10]}"
    assert set(ids) == ok_ids, (f"missing: {sorted(ok_ids - set(ids))[:10]}, "
                                f"unexpected: {sorted(set(ids) - ok_ids)[:10]}")
    assert set(failed_registry(c, job)) == set(failed_ids)
    snap = c.status(job)
    assert snap["completed"] == len(rows)
    assert snap["failed"] == len(failed_ids)
    assert snap["total"] == len(ok_ids) + len(failed_ids)
    assert snap["total_output_tokens"] == sum(r["metadata"]["completion_tokens"] for r in rows)
    assert snap["total_input_tokens"] == sum(r["metadata"]["prompt_tokens"] for r in rows)
    assert sum(g["completed"] for g in snap["gpus"].values()) == len(rows)
    return rows


def kombu_entry(body: bytes, content_type: str, queue: str, task: str = "dflash_tasks.generate",
                args: list | None = None) -> str:
    """A queue entry in kombu's Redis envelope, as `LPUSH gpuN <entry>` would deliver it."""
    tid = str(uuid.uuid4())
    return json.dumps({
        "body": base64.b64encode(body).decode(),
        "content-encoding": "utf-8" if content_type == "application/json" else "binary",
        "content-type": content_type,
        "headers": {"lang": "py", "task": task, "id": tid, "root_id": tid, "parent_id": None,
                    "group": None, "retries": 0, "eta": None, "expires": None,
                    "argsrepr": repr(args or []), "kwargsrepr": "{}", "origin": "test"},
        "properties": {"correlation_id": tid, "reply_to": "", "delivery_mode": 2,
                       "delivery_info": {"exchange": "", "routing_key": queue}, "priority": 0,
                       "body_encoding": "base64", "delivery_tag": str(uuid.uuid4())},
    })


def pickled_task(queue: str, args: list) -> str:
    return kombu_entry(pickle.dumps((args, {}, {})), "application/x-python-serialize", queue,
                       args=args)


def reference_ids(url: str, prompt: str, max_tokens: int) -> list[int]:
    """The response ids of one uninterrupted generation of the prompt on a simulated server
    (deterministic, as SGLang at temperature 0): what a moved row, or one made in rounds, must
    equal id for id."""
    body = {"model": "Qwen/Qwen3-8B", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "return_token_ids": True,
            "chat_template_kwargs": {"enable_thinking": True}, "separate_reasoning": True}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()[
        "choices"][0]["response_token_ids"]

