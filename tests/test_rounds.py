"""The end game in rounds (dispatch/window.py's round_cap, dispatch/lua/next_round.lua): near the
end of a job a request runs one round of tokens at most; one cut there goes to the back of
pending with its exact tokens and whichever GPU frees a slot goes on from them. Every prompt is
so started before any goes on, and the last starts are a round long at most. Each row is the one
an uninterrupted generation gives (the simulated server, like SGLang at temperature 0, goes on
from a sequence exactly as it would have), counted once, its metadata naming the GPUs that made
it and their shares; a cut at a round's end is never a row."""
from __future__ import annotations

from hashlib import sha1

import pytest
import redis as redis_lib
from conftest import write_jsonl
from failure_support import check_books, counters, prompts, reference_ids

from dflash_tasks.core import jobs
from dflash_tasks.core.keys import JobName
from dflash_tasks.core.settings import Settings
from dflash_tasks.dispatch import window
from dflash_tasks.ledger import Ledger
from dflash_tasks.ledger.messages import encode_messages

GPU = "gpu0@a"


def test_a_request_runs_one_round_once_few_prompts_are_pending():
    s = Settings()  # the deployed rounds: 2,048 tokens, once fewer than 10 prompts per slot wait
    assert (s.endgame_round_tokens, s.endgame_rounds_depth) == (2048, 10.0)
    slots = 64 * 8
    assert window.round_cap(s, 8192, 0, 10 * slots, slots) == 8192        # the run's bulk
    assert window.round_cap(s, 8192, 0, 10 * slots - 1, slots) == 2048    # its end
    assert window.round_cap(s, 8192, 3000, 0, slots) == 5048               # one round further
    assert window.round_cap(s, 8192, 7000, 0, slots) == 8192               # never past the cap
    # Prompt and cap overflow the context: the whole cap, for the server to refuse in its words.
    assert window.round_cap(s, 8192, 3000, 0, slots, overflows=True) == 8192
    assert window.round_cap(Settings(endgame_round_tokens=0), 8192, 0, 0, slots) == 8192


def test_a_generation_cut_at_its_rounds_end_goes_behind_the_prompts_not_started(redis_url):
    r = redis_lib.Redis.from_url(redis_url)
    job, book = JobName("rounds"), Ledger(r)
    jobs.save(r, job, jobs.GenerationParams(), selection=jobs.GpuSelection(), dataset="x")
    book.add_prompts(job, [(f"p{i}", encode_messages([{"role": "user", "content": f"q{i}"}]))
                           for i in range(4)])
    taken = window.take(r, Settings(), job, GPU, 2, task="dflash_tasks.generate", origin="t",
                        reply_to="")
    assert taken == ["p0", "p1"]
    first = {p: sha1(r.hget(job.prompts, p)).hexdigest() for p in ("p0", "p1")}
    assert window.next_round(r, job, "p0", GPU, b"entry", 1024, first["p0"])
    assert [i.decode() for i in r.lrange(job.pending, 0, -1)] == ["p2", "p3", "p0"]
    assert r.hget(job.prompts, "p0") == b"entry" and r.zscore(job.inflight(GPU), "p0") is None
    # Once only: a second delivery of the same round moves nothing, nor does a prompt recalled.
    assert not window.next_round(r, job, "p0", GPU, b"other", 1024, first["p0"])
    window.recall(r, job, GPU, ["p1"])
    assert not window.next_round(r, job, "p1", GPU, b"other", 1024, first["p1"])
    assert r.hget(job.prompts, "p0") == b"entry"
    # A stale delivery of the first round, still running while the generation went on and was
    # dispatched here again, hands nothing on: its round is not counted twice.
    r.lrem(job.pending, 1, "p0")
    r.zadd(job.inflight(GPU), {"p0": 1})
    assert not window.next_round(r, job, "p0", GPU, b"stale", 1024, first["p0"])
    assert r.hget(job.prompts, "p0") == b"entry" and r.zscore(job.inflight(GPU), "p0") == 1
    c = counters(type("C", (), {"r": r}), "rounds")
    assert (c["rounds"], c["round_tokens"]) == (1, 1024)


@pytest.mark.timeout(400)
def test_a_job_in_rounds_gives_each_prompt_the_row_of_one_uninterrupted_generation(cluster,
                                                                                   tmp_path):
    """The deployed settings on two GPUs of 4 slots: 24 prompts are fewer than 10 per slot, so
    the whole job runs in rounds. The real run's lengths (median 1,800, 18% over 4,096) under a
    cap of 6,144: some end in their first round, some at the cap after three."""
    c = cluster()
    sim = ("--slots", "4", "--decode-tps", "8000")
    for gpu in (0, 1):
        c.start_server(gpu, *sim)
        c.start_worker(gpu, "--concurrency", "4")
    c.start_beat()
    rows = prompts(24)
    c.manage("enqueue", "--dataset", str(write_jsonl(tmp_path / "d.jsonl", rows)), "--job", "r",
             "--max-output-tokens", "6144")
    c.wait_done("r", timeout=300)
    done = check_books(c, "r", {row["id"] for row in rows})
    lengths = sorted(row["metadata"]["completion_tokens"] for row in done)
    assert lengths[0] < 2048 and lengths[-1] == 6144, lengths
    went_on = [row for row in done if row["metadata"]["completion_tokens"] > 2048]
    assert went_on and counters(c, "r")["rounds"] >= len(went_on)
    reference = c.start_server(2, *sim)
    asked = {row["id"]: row["prompt"] for row in rows}
    for row in done:
        meta = row["metadata"]
        # A cut at a round's end is never a row: `length` only at the job's cap.
        assert meta["finish_reason"] == "stop" or meta["completion_tokens"] == 6144, meta
        assert row["token_ids"]["response"] == \
            reference_ids(f"http://127.0.0.1:{reference}", asked[row["id"]], 6144), row["id"]
        assert len(row["token_ids"]["response"]) == meta["completion_tokens"]
        # Every request of the job ran one round at most: a longer row was made in rounds (or
        # moved, if the machine's noise made one GPU look slower), and names each GPU's share.
        if "gpus" in meta or meta["completion_tokens"] > 2048:
            shares = meta["gpus"]
            assert sum(g["tokens"] for g in shares) == meta["completion_tokens"], shares
            # the tokens before its last request: whole rounds, or what it had when moved
            assert 0 <= meta.get("continued_tokens", 0) < meta["completion_tokens"], meta
            assert all(a["gpu"] != b["gpu"] for a, b in zip(shares, shares[1:])), shares
        else:
            assert "gpus" not in meta and "continued_tokens" not in meta, meta
    assert c.status("r")["total_output_tokens"] == sum(lengths)   # each token counted once
