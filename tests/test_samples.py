"""Samples per prompt (issue 39): `enqueue --samples N` makes N rows of each prompt, each its own
prompt in the ledger (id "<prompt>#<k>"), generated, resumed and retried alone. The simulated
servers sample (--sampling random): each request at a temperature above 0 draws an output of its
own from the server's own random state, as SGLang does when no seed is sent, so the samples of a
prompt differ, and a continuation goes on with the output it began."""
from __future__ import annotations

import json
from collections import Counter

import httpx
from conftest import write_jsonl

from dflash_tasks.core.jobs import request_seed

SIM = ("--sampling", "random", "--slots", "32", "--decode-tps", "6000", "--median-tokens", "120",
       "--p-over-4096", "0.001")


def prompts(n: int) -> list[dict]:
    return [{"id": f"q{i:03d}", "prompt": f"Question {i}: what follows {i * 7}?"} for i in range(n)]


def output(row: dict) -> tuple[str, str]:
    answer = row["conversations"][-1]
    return answer.get("reasoning_content") or "", answer.get("content") or ""


def test_four_samples_of_500_prompts_are_2000_distinct_rows(cluster, tmp_path):
    c = cluster()  # stopped after the test: no worker outlives it
    for gpu in (0, 1):
        c.start_server(gpu, *SIM)
        c.start_worker(gpu)
    c.start_beat()
    data = write_jsonl(tmp_path / "d.jsonl", prompts(500))
    out = c.manage("enqueue", "--dataset", str(data), "--job", "many", "--samples", "4",
                   "--max-output-tokens", "2048")
    assert "samples per prompt" in out.stdout
    c.wait_done("many", timeout=600)
    rows = c.rows("many")
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 2000
    assert set(ids) == {f"q{i:03d}#{k}" for i in range(500) for k in range(4)}
    by_prompt: dict[str, set] = {}
    for r in rows:
        by_prompt.setdefault(r["id"].rpartition("#")[0], set()).add(output(r))
    assert all(len(outputs) == 4 for outputs in by_prompt.values()), \
        [p for p, o in by_prompt.items() if len(o) < 4][:5]
    assert len({output(r) for r in rows}) == 2000
    # Each sample sent its own seed (SGLang reads it under --enable-deterministic-inference only,
    # where a request without one gets 42, the same for every sample).
    seeds = {s["rid"].split(":")[2]: s["seed"] for url in c.server_urls
             for s in httpx.get(f"{url}/sim/sampling", timeout=30).json() if s["endpoint"] == "chat"}
    assert seeds == {i: request_seed("many", i) for i in ids} and len(set(seeds.values())) == 2000
    stats = json.loads(c.manage("stats", "--job", "many", "--json").stdout)
    assert stats["rows_per_prompt"] == {"samples": 4, "prompts": 500, "mean": 4.0}
    assert stats["sample"]["repeated_samples"] == 0

    # Resume: nothing new. A resume may add samples (#4), never take any back.
    again = c.manage("enqueue", "--dataset", str(data), "--job", "many")
    assert c.status("many")["total"] == 2000, again.stdout
    fewer = c.manage("enqueue", "--dataset", str(data), "--job", "many", "--samples", "2", check=False)
    assert fewer.returncode != 0 and "never takes them back" in fewer.stderr
    c.manage("enqueue", "--dataset", str(data), "--job", "many", "--samples", "5", "--limit", "10")
    c.wait_done("many", timeout=300)
    fifth = {r["id"] for r in c.rows("many")} - set(ids)
    assert fifth == {f"q{i:03d}#4" for i in range(10)}


def test_a_job_of_one_sample_keeps_its_ids(cluster, tmp_path):
    c = cluster()  # stopped after the test: no worker outlives it
    data = write_jsonl(tmp_path / "d.jsonl", prompts(3))
    c.manage("enqueue", "--dataset", str(data), "--job", "one")
    assert {k.decode() for k in c.r.hkeys("dflash:{one}:prompts")} == {"q000", "q001", "q002"}
    more = c.manage("enqueue", "--dataset", str(data), "--job", "one", "--samples", "3", check=False)
    assert more.returncode != 0 and "needs a new job" in more.stderr and "Traceback" not in more.stderr
    assert c.status("one")["total"] == 3


def test_failed_samples_are_retried_alone(cluster, tmp_path):
    """A prompt too long for the context at the job's cap fails in every sample, each in the
    registry under its own id; `retry-failed` after a smaller cap brings each back alone, and
    each becomes a row of its own."""
    c = cluster()  # stopped after the test: no worker outlives it
    c.start_server(0, *SIM, "--context-length", "1024")
    c.start_worker(0)
    c.start_beat()
    long = {"id": "long", "prompt": " ".join(f"word{i}" for i in range(700))}
    data = write_jsonl(tmp_path / "d.jsonl", [long, *prompts(5)])
    c.manage("enqueue", "--dataset", str(data), "--job", "fit", "--samples", "3",
             "--max-output-tokens", "512")
    c.wait_done("fit", timeout=300)
    failed = {k.decode() for k in c.r.hkeys("dflash:{fit}:failed")}
    assert failed == {"long#0", "long#1", "long#2"}
    assert len(c.rows("fit")) == 15
    c.manage("set", "--job", "fit", "--max-output-tokens", "256")
    c.manage("retry-failed", "--job", "fit", "--include-permanent")
    c.wait_done("fit", timeout=300)
    rows = c.rows("fit")
    longs = [r for r in rows if r["id"].startswith("long#")]
    assert sorted(r["id"] for r in longs) == ["long#0", "long#1", "long#2"]
    assert len({output(r) for r in longs}) == 3
    assert Counter(r["id"] for r in rows).most_common(1)[0][1] == 1
