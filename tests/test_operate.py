"""Operating a run: length statistics against the simulated server's known distribution,
raising max tokens mid-run, pause / resume / cancel with nothing lost."""
from __future__ import annotations

import json
from itertools import accumulate

from conftest import write_jsonl
from support import wait_until
from test_pipeline import start

from dflash_dev.sim.lengths import chat_plan
from dflash_tasks.output.stats import percentile


def prompts(tmp_path, n: int):
    rows = [{"id": f"q{i:05d}", "prompt": f"Task {i}: reason about case {i * 104729 % 9973}."}
            for i in range(n)]
    return write_jsonl(tmp_path / "prompts.jsonl", rows), rows


def expected(rows, max_tokens):
    return {r["id"]: chat_plan([{"role": "user", "content": r["prompt"]}], max_tokens) for r in rows}


def test_stats_match_the_known_length_distribution(cluster, tmp_path):
    c = cluster()
    start(c)
    path, rows = prompts(tmp_path, 600)
    c.manage("enqueue", "--dataset", str(path), "--job", "lengths", "--gpus", "2",
             "--max-output-tokens", "4096")
    c.wait_done("lengths")
    plan = expected(rows, 4096)
    lengths = sorted(p.completion_tokens for p in plan.values())
    truncated = sum(p.finish_reason == "length" for p in plan.values())

    out = json.loads(c.manage("stats", "--job", "lengths", "--json", "--sample", "600",
                              "--plot", str(tmp_path / "lengths.png")).stdout)
    assert out["finish_reasons"] == {"length": truncated, "stop": 600 - truncated}
    assert out["truncated_pct"] == round(100 * truncated / 600, 2)
    assert 10 < out["truncated_pct"] < 30  # the real run's 18% at a 4,096 cap
    hist = out["output_tokens"]
    for q in (50, 90, 99):
        exact = percentile(lengths, q)
        assert exact - 64 < hist[f"p{q}"] <= exact, (q, exact, hist)
    assert hist["max"] == 4096 == lengths[-1]
    sample = out["sample"]
    assert sample["rows"] == 600
    assert [sample["output_tokens"][f"p{q}"] for q in (50, 90, 99)] == \
        [percentile(lengths, q) for q in (50, 90, 99)]
    assert sample["truncated_thinking_pct"] + sample["truncated_answer_pct"] == \
        sample["truncated_pct"]
    assert sample["truncated_thinking_pct"] > 0  # long reasoning is where a 4,096 cap bites
    assert sample["think_markers_in_content"] == 0
    assert (tmp_path / "lengths.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    table = c.manage("stats", "--job", "lengths").stdout
    assert "finish reasons: length" in table and "truncated:" in table


def test_raising_max_tokens_mid_run_reaches_every_prompt_not_yet_sent(cluster, tmp_path):
    c = cluster()
    start(c, sim_args=("--slots", "40", "--decode-tps", "1000"))  # slow enough to change mid-run
    path, rows = prompts(tmp_path, 1200)
    c.manage("enqueue", "--dataset", str(path), "--job", "raise", "--gpus", "2",
             "--max-output-tokens", "4096")
    wait_until(lambda: c.status("raise")["completed"] >= 100, timeout=120, what="100 completions")
    out = c.manage("set", "--job", "raise", "--max-output-tokens", "8192").stdout
    assert "max_tokens         4096 -> 8192  (changed)" in out
    c.wait_done("raise")

    rows_out = c.rows("raise")
    caps = {r["metadata"]["max_tokens"] for r in rows_out}
    assert caps == {4096, 8192}  # prompts sent before the change kept their cap
    plan = {4096: expected(rows, 4096), 8192: expected(rows, 8192)}
    for row in rows_out:
        meta = row["metadata"]
        want = plan[meta["max_tokens"]][row["id"]]
        assert (meta["completion_tokens"], meta["finish_reason"]) == \
            (want.completion_tokens, want.finish_reason), row["id"]
    assert c.status("raise")["params"]["max_tokens"] == 8192


def test_pause_resume_cancel_lose_nothing(cluster, tmp_path):
    c = cluster()
    # Small, slow servers (about 6 completions/s in all): the job cannot finish between two
    # commands, however loaded the machine is.
    start(c, sim_args=("--slots", "8", "--decode-tps", "1000"))
    path, rows = prompts(tmp_path, 1500)
    c.manage("enqueue", "--dataset", str(path), "--job", "steer", "--gpus", "2")
    wait_until(lambda: c.status("steer")["completed"] >= 50, timeout=120, what="50 completions")

    c.manage("pause", "--job", "steer")
    paused = wait_until(lambda: (s := c.status("steer"))["in_flight"] == 0 and s, timeout=120,
                        what="requests in flight to finish")
    assert paused["status"] == "paused" and paused["pending"] > 0
    assert paused["completed"] + paused["pending"] == 1500  # nothing lost while paused
    assert paused["eta_hours"] is None and paused["rate_per_sec"] > 0  # no end while paused

    c.manage("resume", "--job", "steer")
    wait_until(lambda: c.status("steer")["completed"] >= paused["completed"] + 100, timeout=120,
               what="progress after resume")
    out = c.manage("cancel", "--job", "steer", "--yes").stdout
    assert "cancelled" in out
    final = wait_until(lambda: (s := c.status("steer"))["in_flight"] == 0
                       and s["unsealed_rows"] == 0 and s, timeout=120, what="the cancelled job to settle")
    # Cancel drops nothing: the prompts never generated stay counted, for `resume`.
    assert final["status"] == "cancelled" and final["total"] == 1500
    assert final["completed"] + final["pending"] == 1500 and final["pending"] > 0
    assert f"{final['pending']:,} never started" in out and final["eta_hours"] is None
    kept = c.rows("steer")
    assert len(kept) == len({r["id"] for r in kept}) == final["completed"]

    jobs = c.manage("jobs").stdout
    assert "steer" in jobs and "cancelled" in jobs
    assert f"steer writes to {c.output_dir}" in jobs.splitlines(), jobs  # the path whole


def test_regenerate_continues_truncated_rows_after_raising_the_cap(cluster, tmp_path):
    """The 4,096 -> 8,192 story: rows cut at the old cap continue from their own token ids
    (SGLang /generate), and each ends exactly as one 8,192-token generation would have."""
    import httpx

    c = cluster()
    start(c)
    path, rows = prompts(tmp_path, 500)
    c.manage("enqueue", "--dataset", str(path), "--job", "story", "--gpus", "2",
             "--max-output-tokens", "4096")
    c.wait_done("story")
    at_4096, at_8192 = expected(rows, 4096), expected(rows, 8192)
    cut = sorted(i for i, p in at_4096.items() if p.finish_reason == "length")
    assert len(cut) > 40

    refused = c.manage("regenerate", "--job", "story", "--finish-reason", "length", "--continue",
                       check=False)
    assert refused.returncode != 0 and "raise it first" in refused.stderr
    c.manage("set", "--job", "story", "--max-output-tokens", "8192")
    out = c.manage("regenerate", "--job", "story", "--finish-reason", "length", "--continue").stdout
    assert f"{len(cut):,} prompts with finish_reason 'length' queued" in out
    assert f"{len(cut) * 4096:,} tokens reused" in out
    snap = c.wait_done("story")

    newest = {}
    for row in c.rows("story"):  # batches in time order: the last row of an id is its newest
        newest[row["id"]] = row
    assert set(newest) == {r["id"] for r in rows}
    for pid, row in newest.items():
        meta = row["metadata"]
        want = at_8192[pid] if pid in cut else at_4096[pid]
        assert (meta["completion_tokens"], meta["finish_reason"]) == \
            (want.completion_tokens, want.finish_reason), pid
        assert len(row["token_ids"]["response"]) == meta["completion_tokens"]
    # Each reuses the 4,096 tokens of its truncated row, and names each GPU's share: the
    # prefix's, then what followed (metadata.gpus), moved or made in rounds meanwhile too.
    for pid in cut:
        meta = newest[pid]["metadata"]
        assert meta["continued_tokens"] == 4096, (pid, meta)
        made = list(accumulate(g["tokens"] for g in meta["gpus"]))
        assert made[-1] == meta["completion_tokens"] and 4096 in made, meta  # the prefix's first

    # A continued row is the same as one generation at the new cap: ids, reasoning and answer.
    one = newest[cut[0]]
    fresh = httpx.post(c.url(0) + "/v1/chat/completions", timeout=60, json={
        "model": one["metadata"]["model"], "messages": one["conversations"][:-1],
        "max_tokens": 8192, "return_token_ids": True}).json()["choices"][0]
    assert fresh["response_token_ids"] == one["token_ids"]["response"]
    assert fresh["message"]["reasoning_content"].split() == one["conversations"][-1]["reasoning_content"].split()
    assert fresh["message"]["content"].split() == one["conversations"][-1]["content"].split()

    # Counters follow the newest rows; the dataset still has one row per id.
    assert snap["completed"] == 500
    assert snap["total_output_tokens"] == sum(r["metadata"]["completion_tokens"] for r in newest.values())
    assert snap["finish_reasons"].get("length", 0) == sum(at_8192[i].finish_reason == "length"
                                                          for i in cut)
    export = c.manage("export", "--job", "story", "--to", str(tmp_path / "export")).stdout
    assert "500 (one per id)" in export and f"{len(cut):,} older rows" in export


def test_a_continuation_whose_cap_was_lowered_again_ends_at_the_cap(cluster, tmp_path):
    """regenerate --continue queues truncated rows with the tokens they have; if the cap is
    lowered to that before they run, there is nothing to continue (found by the chaos test,
    seed 411): each ends at the job's cap with the ids it has, the row one request capped there
    gives, not generated again. A move whose abort came as the generation reached the cap
    leaves the same entry (tests/test_continuation_sample.py met it one run in three)."""
    c = cluster()
    start(c, gpus=(0,))
    path, rows = prompts(tmp_path, 80)
    c.manage("enqueue", "--dataset", str(path), "--job", "lower", "--gpus", "1",
             "--max-output-tokens", "1024")
    c.wait_done("lower")
    first = {row["id"]: row for row in c.rows("lower")}
    at_1024 = expected(rows, 1024)
    cut = sorted(i for i, p in at_1024.items() if p.finish_reason == "length")
    assert cut
    c.workers[0].stop()  # so the continuations wait in the queue until the cap changes again
    c.manage("set", "--job", "lower", "--max-output-tokens", "2048")
    c.manage("regenerate", "--job", "lower", "--finish-reason", "length", "--continue")
    c.manage("set", "--job", "lower", "--max-output-tokens", "1024")
    c.start_worker(0)
    snap = c.wait_done("lower")
    assert snap["failed"] == 0 and snap["completed"] == 80
    newest = {row["id"]: row for row in c.rows("lower")}
    for pid in cut:
        meta = newest[pid]["metadata"]
        assert (meta["completion_tokens"], meta["finish_reason"]) == (1024, "length"), pid
        assert meta["continued_tokens"] == 1024 and meta["gpus"][0]["tokens"] == 1024, meta
        assert newest[pid]["token_ids"] == first[pid]["token_ids"], pid
        assert newest[pid]["conversations"] == first[pid]["conversations"], pid


def test_status_shows_each_servers_own_load_from_its_metrics(cluster, tmp_path):
    c = cluster()  # the deployed sampling period (2 s)
    start(c, gpus=(0,), sim_args=("--slots", "8", "--decode-tps", "300"))
    path, _ = prompts(tmp_path, 120)
    c.manage("enqueue", "--dataset", str(path), "--job", "load", "--gpus", "1")
    server = wait_until(lambda: (g := c.status("load")["gpus"][c.gpu(0)]["server"])
                        and g["running"] == 8 and g, timeout=60,
                        what="the server's metrics to show its 8 slots busy")
    assert server["error"] is None and server["gen_throughput"] >= 0 and server["age_s"] < 30
    assert "server: 8 running" in c.manage("status", "--job", "load").stdout
    c.manage("cancel", "--job", "load", "--yes")
    # --watch returns once the job has ended, and says how: cancelled is not success
    watched = c.manage("status", "--job", "load", "--watch", check=False)
    assert watched.returncode == 1 and "cancelled" in watched.stdout
