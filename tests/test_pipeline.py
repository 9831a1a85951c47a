"""The generation pipeline end to end: real Redis, simulated SGLang servers, Celery worker
subprocesses pinned to them, beat sealing batches. Every valid prompt id comes out exactly once,
and the counters equal the sums over the output rows, whatever is killed along the way."""
from __future__ import annotations

import json
from collections import Counter

from conftest import write_jsonl
from failure_support import sim_hold, sim_release, sim_stats
from support import wait_until

SIM_ARGS = ("--slots", "40", "--decode-tps", "4000")


def start(c, gpus=(0, 1), sim_args=SIM_ARGS, beat=True):
    """The tests' usual deployment on `c`: a simulated server and a worker per GPU, and beat."""
    for gpu in gpus:
        c.start_server(gpu, *sim_args)
        c.start_worker(gpu)
    if beat:
        c.start_beat()


def dataset(tmp_path, n: int, bad_lines: bool = False):
    rows = [{"id": f"p{i:05d}", "prompt": f"Question {i}: explain idea number {i * 7919 % 1000}."}
            for i in range(n)]
    if bad_lines:
        rows[10:10] = ['{"id": "broken", "prompt": ', {"id": "empty", "messages": []},
                       {"id": "who", "conversations": [{"role": "narrator", "content": "x"}]},
                       rows[3]]  # a duplicate id
    return write_jsonl(tmp_path / "prompts.jsonl", rows), {f"p{i:05d}" for i in range(n)}


def assert_exactly_once(c, job: str, expected_ids: set[str]) -> list[dict]:
    rows = c.rows(job)
    ids = [row["id"] for row in rows]
    doubled = [i for i, n in Counter(ids).items() if n > 1]
    assert not doubled, f"ids in two rows: {doubled[:10]}"
    assert set(ids) == expected_ids, f"missing: {sorted(expected_ids - set(ids))[:10]}"
    snap = c.status(job)
    assert snap["completed"] == len(rows) == snap["total"]
    assert snap["failed"] == 0
    assert snap["total_output_tokens"] == sum(r["metadata"]["completion_tokens"] for r in rows)
    assert snap["total_input_tokens"] == sum(r["metadata"]["prompt_tokens"] for r in rows)
    assert snap["finish_reasons"] == dict(Counter(r["metadata"]["finish_reason"] for r in rows))
    assert sum(g["completed"] for g in snap["gpus"].values()) == len(rows)
    return rows


def test_run_completes_with_every_id_once_and_bad_rows_reported(cluster, tmp_path):
    c = cluster()
    start(c)
    path, ids = dataset(tmp_path, 400, bad_lines=True)

    out = c.manage("enqueue", "--dataset", str(path), "--job", "small", "--gpus", "2",
                   "--max-output-tokens", "4096")
    assert "line 11: " in out.stderr and "not valid JSON" in out.stderr
    assert "line 12: conversation is empty" in out.stderr
    assert "line 13: unknown role 'narrator'" in out.stderr
    assert "duplicate ids in dataset  1" in out.stdout
    assert "new prompts queued        400" in out.stdout

    c.wait_done("small")
    rows = assert_exactly_once(c, "small", ids)
    row = rows[0]
    assert row["conversations"][0] == {"role": "user", "content": row["conversations"][0]["content"]}
    assistant = row["conversations"][-1]
    assert assistant["role"] == "assistant" and assistant["reasoning_content"]
    meta = row["metadata"]
    for field in ("finish_reason", "prompt_tokens", "completion_tokens", "max_tokens",
                  "enable_thinking", "gpu", "model", "latency_s", "attempts"):
        assert field in meta, field
    assert meta["max_tokens"] == 4096 and meta["enable_thinking"] is True
    assert max(r["metadata"]["completion_tokens"] for r in rows) <= 4096
    assert {r["status"] for r in rows} <= {"success", "truncated"}
    assert len(row["token_ids"]["response"]) == meta["completion_tokens"]
    # Both GPUs took work: dispatch follows each server, not a static split.
    assert {r["metadata"]["gpu"] for r in rows} == {c.gpu(0), c.gpu(1)}
    progress = json.loads((c.output_dir / "small" / "progress.json").read_text())
    assert progress["completed"] == 400 and progress["status"] == "done"
    # The ledger holds every outcome: the prompts' tasks stored no Celery result.
    assert not list(c.r.scan_iter("celery-task-meta-*"))


def test_resume_after_everything_is_killed_does_only_the_rest(cluster, tmp_path):
    c = cluster(visibility_timeout_s=15, reap_after_s=30)
    start(c)
    path, ids = dataset(tmp_path, 1200)
    # Held mid-run (the servers answer nothing more after 150 answers each), whatever the
    # machine's speed, then killed.
    sim_hold(c.url(0), c.url(1), after=150)
    c.manage("enqueue", "--dataset", str(path), "--job", "resume", "--gpus", "2")
    wait_until(lambda: all(sim_stats(url)["held"] for url in (c.url(0), c.url(1))), timeout=120,
               what="both servers holding their answers after 150 each")
    for proc in [*c.workers.values(), c.beat]:
        proc.kill()
    sim_release(c.url(0), c.url(1))
    before = c.status("resume")
    assert 0 < before["completed"] < 1200

    again = c.manage("enqueue", "--dataset", str(path), "--job", "resume")
    assert "new prompts queued        0" in again.stdout
    assert f"already done              {before['completed']:,}" in again.stdout
    for gpu in (0, 1):
        c.start_worker(gpu)
    c.start_beat()
    c.wait_done("resume", timeout=300)
    assert_exactly_once(c, "resume", ids)


def test_sigkill_of_a_worker_mid_run_loses_and_doubles_nothing(cluster, tmp_path):
    c = cluster(visibility_timeout_s=15, reap_after_s=30)
    start(c)
    path, ids = dataset(tmp_path, 2000)
    c.manage("enqueue", "--dataset", str(path), "--job", "kill", "--gpus", "2")
    wait_until(lambda: c.status("kill")["gpus"][c.gpu(1)]["completed"] >= 200, timeout=120,
               what="gpu1 to complete 200 prompts")
    c.workers[1].kill()
    assert c.status("kill")["gpus"][c.gpu(1)]["in_flight"] > 0  # work was lost with the worker
    c.start_worker(1)
    c.wait_done("kill", timeout=400)
    assert_exactly_once(c, "kill", ids)
