"""The end game at the physical limit (issue 29): once nothing waits, a generation still running
on a measurably slower GPU is aborted there and continued on a GPU with a free slot, from its
exact tokens, as one row: its response the partial output followed by the continuation (the
simulated server, like SGLang at temperature 0, continues a sequence exactly as it would have
gone on), its counters counting each token once, its metadata naming every GPU that worked on
it. A warm stop takes the same path, so its long generations are neither thrown away nor waited
for. Each way a move can break leaves one row: an order that lapses, a hand-over whose prompt
left meanwhile, a worker killed between the hand-over and its message. A move aborts exactly its
own request, whatever the prompt ids (issue 38)."""
from __future__ import annotations

import contextlib
import json
import time
from hashlib import sha1
from pathlib import Path

import httpx
import pytest
import redis as redis_lib
from conftest import write_jsonl
from failure_support import check_books, counters, prompts, reference_ids, sim_stats
from support import wait_until

from dflash_tasks.core import jobs
from dflash_tasks.core.keys import MIGRATIONS, JobName
from dflash_tasks.core.settings import Settings
from dflash_tasks.dispatch import window as dispatch_window
from dflash_tasks.ledger import Ledger
from dflash_tasks.ledger.messages import encode_messages
from dflash_tasks.worker.shutdown import Shutdown

FAST, SLOW = "gpu0@a", "gpu1@a"


def _job(r, name: str, n: int) -> Ledger:
    name = JobName(name)
    book = Ledger(r)
    jobs.save(r, name, jobs.GenerationParams(), selection=jobs.GpuSelection(), dataset="x")
    book.add_prompts(name, [(f"p{i}", encode_messages([{"role": "user", "content": f"q{i}"}]))
                            for i in range(n)])
    return book


def _take(book: Ledger, job: str, gpu: str, window: int) -> list[str]:
    job = JobName(job)
    return dispatch_window.take(book.r, Settings(), job, gpu, window, task="dflash_tasks.generate",
                                origin="t", reply_to="")


def test_a_move_aborts_exactly_the_requests_of_its_prompt_and_no_rid_begins_another():
    """Prompt ids are free text: `x`'s rid once began those of `x:1` and `x:10`, and the
    registry aborted by that prefix. It aborts by (job, prompt id) now, and every rid begins
    with a token of its own, as SGLang's /abort_request matches by prefix."""
    running, aborted = Shutdown(), []
    requests = [("j", "x"), ("j", "x:1"), ("j", "x:10"), ("j", "x:"), ("other", "x"), ("j", "x")]
    rids = [running.request_id(job, pid, 1) for job, pid in requests]
    with contextlib.ExitStack() as stack:
        for i, ((job, pid), rid) in enumerate(zip(requests, rids)):
            stack.enter_context(running.tracked(job, pid, rid, lambda i=i: aborted.append(i)))
        assert running.abort_prompt("j", "x") == 2 and aborted == [0, 5]  # a second delivery too
        assert running.abort_prompt("j", "x:1") == 1 and aborted[2:] == [1]
        assert running.abort_prompt("j", "y") == 0 and running.abort_prompt("other", "x:1") == 0
    assert running.abort_prompt("j", "x") == 0   # a request that ended is no longer tracked
    assert not [(a, b) for a in rids for b in rids if a is not b and b.startswith(a)]
    token, _, rest = rids[1].partition(":")
    assert len(token) == 32 and rest == "j:x:1:1"  # readable in the logs after its token


def test_an_idle_fast_gpu_orders_the_last_generation_of_a_slower_one_moved(redis_url):
    r = redis_lib.Redis.from_url(redis_url)
    book, k = _job(r, "end", 6), JobName("end")
    assert len(_take(book, "end", SLOW, 6)) == 6          # everything runs on the slow GPU
    r.delete(SLOW)                                        # its worker took every message
    r.hset(k.speed, mapping={FAST: 100.0, SLOW: 50.0})
    r.sadd(k.gpus, FAST)
    newest = r.zrevrange(k.inflight(SLOW), 0, 0)[0].decode()
    r.zadd(k.retrying(SLOW), {newest: time.time() + 60})  # a retry waiting is not running
    assert _take(book, "end", FAST, 2) == []              # nothing to take: an order instead
    orders = {i.decode(): v.decode() for i, v in r.hgetall(k.migrating).items()}
    [(ordered, order)] = orders.items()
    assert ordered != newest and order.startswith(f"{SLOW} {FAST} ")
    assert r.lrange(MIGRATIONS + SLOW, 0, -1) == [f"end\n{ordered}".encode()]
    _take(book, "end", FAST, 2)                           # a second free slot, a second order
    _take(book, "end", FAST, 2)                           # no third: two slots
    assert r.hlen(k.migrating) == 2
    assert dispatch_window.migration_target(r, JobName("end"), ordered, SLOW) == FAST
    assert dispatch_window.migration_target(r, JobName("end"), ordered, FAST) is None

    # The hand-over moves the prompt and its entry once; a second (a duplicate) moves nothing,
    # nor does one whose entry is no longer the one its request started from.
    read = {pid: sha1(r.hget(k.prompts, pid)).hexdigest() for pid in (ordered, newest)}
    assert not dispatch_window.hand_over(r, JobName("end"), ordered, SLOW, FAST, b"entry", 123,
                                         sha1(b"an older entry").hexdigest())
    assert dispatch_window.hand_over(r, JobName("end"), ordered, SLOW, FAST, b"entry", 123,
                                     read[ordered])
    assert r.zscore(k.inflight(FAST), ordered) is not None
    assert r.zscore(k.inflight(SLOW), ordered) is None and r.hget(k.prompts, ordered) == b"entry"
    assert not dispatch_window.hand_over(r, JobName("end"), ordered, SLOW, FAST, b"entry", 123,
                                         read[ordered])
    c = counters(type("C", (), {"r": r}), "end")
    assert (c["migrated"], c["migrated_tokens"]) == (1, 123)
    # An order whose prompt left the GPU (its row came, it was recalled) lapses at the next take.
    [other] = [i for i in (v.decode() for v in r.hkeys(k.migrating))]
    dispatch_window.recall(r, JobName("end"), SLOW, [other])
    assert not dispatch_window.hand_over(r, JobName("end"), other, SLOW, FAST, b"entry", 5,
                                         sha1(r.hget(k.prompts, other)).hexdigest())
    _take(book, "end", FAST, 4)
    assert other.encode() not in r.hkeys(k.migrating)
    # A GPU no faster than the others orders nothing.
    r.hset(k.speed, FAST, 55.0)
    r.delete(k.migrating, MIGRATIONS + SLOW)
    assert _take(book, "end", FAST, 8) == [] and not r.exists(k.migrating)


@pytest.mark.timeout(400)
def test_long_generations_on_a_slow_gpu_finish_on_the_fast_one_as_one_row(cluster, tmp_path):
    """Two servers, one 4 times slower; generations of 1,500 tokens. Once nothing waits, the
    fast GPU's free slots take over the slow one's running generations. Each moved row is the
    one an uninterrupted generation gives (compared id for id with a third server's), counted
    once, its metadata naming both GPUs and their shares."""
    c = cluster()
    # The moves alone: the end game's rounds (on by default; tests/test_rounds.py) would cut
    # these generations at 1,024 tokens and continue them wherever a slot frees up first.
    c.env["DFLASH_ENDGAME_ROUND_TOKENS"] = "0"
    sim = ("--slots", "4", "--decode-tps", "600", "--fixed-tokens", "1500")
    c.start_server(0, *sim)
    c.start_server(1, *sim, "--slow-factor", "4")
    c.start_worker(0, "--concurrency", "4")
    c.start_worker(1, "--concurrency", "4")
    c.start_beat()
    rows = prompts(24)
    c.manage("enqueue", "--dataset", str(write_jsonl(tmp_path / "d.jsonl", rows)), "--job", "tail",
             "--max-output-tokens", "4096")
    c.wait_done("tail", timeout=300)
    done = check_books(c, "tail", {row["id"] for row in rows})
    moved = [row for row in done if "gpus" in row["metadata"]]
    assert moved, "no generation was moved"
    assert counters(c, "tail")["migrated"] >= len(moved)
    reference = c.start_server(2, *sim)
    asked = {row["id"]: row["prompt"] for row in rows}
    for row in moved:
        meta = row["metadata"]
        assert [g["gpu"] for g in meta["gpus"]] == [c.gpu(1), c.gpu(0)], meta["gpus"]
        assert sum(g["tokens"] for g in meta["gpus"]) == meta["completion_tokens"] == 1500
        # Moved, nothing of it was a truncated row's prefix: continued_tokens says only that.
        assert meta["gpu"] == c.gpu(0) and "continued_tokens" not in meta
        assert row["token_ids"]["response"] == \
            reference_ids(f"http://127.0.0.1:{reference}", asked[row["id"]], 4096), row["id"]
    snap = c.status("tail")
    assert snap["total_output_tokens"] == 1500 * len(rows)   # each token counted once


@pytest.mark.timeout(400)
def test_a_warm_stop_hands_its_generations_over_with_their_tokens(cluster, tmp_path):
    """The deployed warm stop (DFLASH_SHUTDOWN_GRACE_S 0): the stopping worker aborts its
    requests at once, and each one's partial output goes back to pending with the prompt; the
    other GPU continues them. The stop takes seconds, not the generations' minutes."""
    c = cluster()
    sim = ("--slots", "8", "--decode-tps", "100", "--fixed-tokens", "3000")
    c.start_server(0, *sim)
    c.start_server(1, "--slots", "8", "--decode-tps", "2000", "--fixed-tokens", "3000")
    stopping = c.start_worker(0, "--concurrency", "8")
    c.start_beat()
    rows = prompts(8)
    c.manage("enqueue", "--dataset", str(write_jsonl(tmp_path / "d.jsonl", rows)), "--job", "stop",
             "--max-output-tokens", "4096")
    wait_until(lambda: httpx.get(f"{c.url(0)}/sim/stats", timeout=5).json()["running"] == 8,
               timeout=60, what="the 8 generations running on GPU 0")
    time.sleep(2)  # a few hundred tokens each, to be kept
    c.start_worker(1, "--concurrency", "8")
    t = time.monotonic()
    stopping.stop(timeout=60)
    assert time.monotonic() - t < 20 and stopping.popen.returncode == 0
    c.wait_done("stop", timeout=240)
    done = check_books(c, "stop", {row["id"] for row in rows})
    assert all(row["metadata"]["gpus"][0]["gpu"] == c.gpu(0)
               and row["metadata"]["gpus"][0]["tokens"] > 50 for row in done), \
        [row["metadata"].get("gpus") for row in done]
    assert counters(c, "stop")["migrated"] == 8


@pytest.mark.timeout(400)
def test_a_worker_killed_between_the_hand_over_and_its_message_loses_nothing(cluster, tmp_path):
    """The slow GPU's worker hands a generation over (hand_over.lua: the prompt is in flight on
    the fast GPU now), and is killed before it publishes the message there: beat finds the
    prompt in flight without a message (the deployed grace) and sends it; one row."""
    c = cluster()
    sim = ("--slots", "2", "--decode-tps", "800", "--fixed-tokens", "1500")
    c.start_server(0, *sim)
    c.start_server(1, *sim, "--slow-factor", "4")
    c.start_worker(0, "--concurrency", "2")
    gate = tmp_path / "gate"
    gate.touch()
    c.env["DFLASH_FAILPOINTS"] = f"generate.after_hand_over=hold:{gate}"
    slow = c.start_worker(1, "--concurrency", "2")
    del c.env["DFLASH_FAILPOINTS"]
    c.start_beat()
    rows = prompts(8)
    # The GPUs' speeds as complete.lua learns them from finished requests, known from the start
    # here (the first slow request would otherwise end after the fast GPU did everything else).
    c.r.hset(JobName("mid").speed, mapping={c.gpu(0): 800.0, c.gpu(1): 200.0})
    c.manage("enqueue", "--dataset", str(write_jsonl(tmp_path / "d.jsonl", rows)), "--job", "mid",
             "--max-output-tokens", "4096")
    wait_until(lambda: Path(f"{gate}.reached").exists(), timeout=200, what="a hand-over held")
    slow.kill()
    c.start_worker(1, "--concurrency", "2")
    c.wait_done("mid", timeout=240)
    check_books(c, "mid", {row["id"] for row in rows})
    assert "dispatching them again" in c.beat.log()
    assert json.loads(c.manage("status", "--job", "mid", "--json").stdout)["failed"] == 0


@pytest.mark.timeout(300)
def test_moving_prompt_x_leaves_x_1_and_x_10_running_and_spends_no_attempt(cluster, tmp_path):
    """Prompts `x`, `x:1` and `x:10` run on GPU 1; the test orders `x` moved to GPU 0 (as
    take.lua does; the GPUs' speeds, unknown here and the ratio out of reach, order nothing on
    their own). Only `x`'s request is aborted: the other two keep decoding on GPU 1, and end in
    one request each."""
    c = cluster()
    c.env["DFLASH_ENDGAME_FASTER_RATIO"] = "1000"  # the test's order is the only one
    c.start_server(0, "--slots", "4", "--decode-tps", "4000", "--fixed-tokens", "2000")
    c.start_server(1, "--slots", "4", "--decode-tps", "100", "--fixed-tokens", "2000")  # 20 s
    slow = c.start_worker(1, "--concurrency", "3")
    c.start_beat()
    ids = ["x", "x:1", "x:10"]
    rows = [{"id": pid, "prompt": f"Tell me about {pid}."} for pid in ids]
    c.manage("enqueue", "--dataset", str(write_jsonl(tmp_path / "d.jsonl", rows)), "--job", "ids",
             "--max-output-tokens", "4096")
    wait_until(lambda: sim_stats(c.url(1))["running"] == 3, timeout=60,
               what="the three generations running on GPU 1")
    c.start_worker(0, "--concurrency", "3")
    k = JobName("ids")
    c.r.hset(k.migrating, "x", f"{c.gpu(1)} {c.gpu(0)} {c.r.time()[0]}")
    c.r.lpush(MIGRATIONS + c.gpu(1), "ids\nx")
    wait_until(lambda: sim_stats(c.url(1))["completed"].get("abort"), timeout=30,
               what="x's request aborted on GPU 1")
    # Seconds into their 20 s: x:1's and x:10's requests are still the ones running there.
    stats = sim_stats(c.url(1))
    assert stats["completed"] == {"abort": 1} and stats["running"] == 2, stats
    c.wait_done("ids", timeout=120)
    done = {row["id"]: row["metadata"] for row in check_books(c, "ids", set(ids))}
    assert [g["gpu"] for g in done["x"]["gpus"]] == [c.gpu(1), c.gpu(0)]
    for pid in ("x:1", "x:10"):
        assert "gpus" not in done[pid] and done[pid]["gpu"] == c.gpu(1), done[pid]
        assert done[pid]["attempts"] == 1 and done[pid]["completion_tokens"] == 2000
    assert sim_stats(c.url(1))["completed"] == {"abort": 1, "stop": 2}
    spent = counters(c, "ids")
    assert spent["migrated"] == 1 and not [n for n in spent if "retr" in n], spent
    assert slow.log().count("aborted here, to be continued on a faster GPU") == 1
