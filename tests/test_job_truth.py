"""The job's truth where two things happen at once (issue 27): `done` is a fact checked where it
is written, work put back moves a done job back to running in the same step, every change of a
state or a parameter is a compare-and-set, and a prompt's bookkeeping moves in one step.

Each interleaving is forced, never raced: the ledger's own scripts on a real Redis, called in
the order that broke before; or real processes held at a named point (DFLASH_FAILPOINTS' `hold`:
the process stops there until the test removes the gate) while the test acts."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import redis as redis_lib
from conftest import Cluster, write_jsonl
from failure_support import prompts
from support import ROOT, python, wait_until

from dflash_tasks.core import jobs
from dflash_tasks.core.keys import JobName
from dflash_tasks.dispatch import window
from dflash_tasks.ledger import Ledger
from dflash_tasks.ledger.messages import encode_messages

GPU = "gpu0@a"


def _row(i: int) -> dict:
    return {"id": f"p{i}", "conversations": [{"role": "user", "content": f"q{i}"},
                                              {"role": "assistant", "content": f"a{i}"}],
            "metadata": {"finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 5,
                         "gpu": GPU, "latency_s": 0.1, "completed_at": 1_700_000_000 + i}}


def _job(r, name: str, n: int) -> Ledger:
    """A running job of n prompts, each dispatched to GPU (take.lua's in-flight set)."""
    name = JobName(name)
    book = Ledger(r)
    jobs.save(r, name, jobs.GenerationParams(), selection=jobs.GpuSelection(), dataset="x")
    book.add_prompts(name, [(f"p{i}", encode_messages([{"role": "user", "content": f"q{i}"}]))
                            for i in range(n)])
    k = JobName(name)
    ids = [i.decode() for i in r.lpop(k.pending, n)]
    r.zadd(k.inflight(GPU), {i: time.time() for i in ids})
    r.sadd(k.gpus, GPU)
    return book


def _status(r, name: str) -> str:
    return r.hget(JobName(name).config, "status").decode()


def _outcomes(book: Ledger, name: str, completed: list[int], failed: list[int]) -> None:
    name = JobName(name)
    for i in completed:
        assert book.complete(name, f"p{i}", GPU, _row(i))
    for i in failed:
        assert book.fail(name, f"p{i}", GPU, {"id": f"p{i}", "reason": "invalid_request",
                                             "class": "permanent"})
    book.r.xtrim(JobName(name).output, maxlen=0)  # sealed and shipped, as far as finish.lua is concerned


def test_done_is_refused_while_a_retried_prompt_waits(redis_url):
    """Item 1: beat's snapshot saw every prompt answered; a retry-failed lands before `done` is
    written. Before: done with a prompt pending and no way out. Now finish.lua sees it."""
    r = redis_lib.Redis.from_url(redis_url)
    book = _job(r, "race1", 3)
    _outcomes(book, "race1", completed=[0, 1], failed=[2])
    records = list(book.failed_records(JobName("race1")))
    assert book.requeue_failed(JobName("race1"), records) == (1, 0)          # lands in the window
    assert book.finish(JobName("race1")) == "completed 2 + failed 0 of 3"
    assert _status(r, "race1") == "running"
    # And once it is done for real, work put back moves it back to running in the same step.
    r.lpop(JobName("race1").pending)
    assert book.complete(JobName("race1"), "p2", GPU, _row(2))
    r.xtrim(JobName("race1").output, maxlen=0)
    assert book.finish(JobName("race1")) == "done" and _status(r, "race1") == "done"


@pytest.mark.parametrize("left", ["in flight", "unsealed", "sealing", "spooled", "short"])
def test_done_needs_every_place_empty(redis_url, left):
    r = redis_lib.Redis.from_url(redis_url)
    book = _job(r, "places", 2)
    _outcomes(book, "places", completed=[0], failed=[] if left == "short" else [1])
    k = JobName("places")
    if left == "in flight":  # a retry waiting for its ETA keeps its in-flight entry
        r.zadd(k.inflight("gpu1@a"), {"p9": 1})
        r.sadd(k.gpus, "gpu1@a")
    elif left == "unsealed":
        r.xadd(k.output, {"id": "p0", "row": "{}"})
    elif left == "sealing":
        r.set(k.sealing, "{}")
    elif left == "spooled":
        r.hset(k.counters, "spooled", 1)
    assert book.finish(JobName("places")) != "done"
    assert _status(r, "places") == "running"


def test_a_late_row_after_done_runs_the_job_again(redis_url):
    """Item 2: a second delivery of a prompt in the failed registry completes after the job is
    done. Its row is recorded, and the job is running again, so beat ships it."""
    r = redis_lib.Redis.from_url(redis_url)
    book = _job(r, "late", 2)
    _outcomes(book, "late", completed=[0], failed=[1])
    assert book.finish(JobName("late")) == "done"
    assert book.complete(JobName("late"), "p1", GPU, _row(1))                 # the late delivery
    assert _status(r, "late") == "running"
    c = book.counters(JobName("late"))
    assert (c["completed"], c["failed"]) == (2, 0)
    assert r.xlen(JobName("late").output) == 1


def test_regenerate_and_enqueue_run_a_done_job_again_in_the_same_step(redis_url):
    from dflash_tasks.ledger import EndedRow

    r = redis_lib.Redis.from_url(redis_url)
    book = _job(r, "again", 1)
    row = {**_row(0), "metadata": {**_row(0)["metadata"], "finish_reason": "length"}}
    assert book.complete(JobName("again"), "p0", GPU, row)
    r.xtrim(JobName("again").output, maxlen=0)
    assert book.finish(JobName("again")) == "done"
    [ended] = book.ended_rows(JobName("again"), "length")
    assert book.reopen(JobName("again"), ended, ended.prompt, 0)
    assert _status(r, "again") == "running"
    r.hset(JobName("again").config, "status", "done")
    assert book.add_prompts(JobName("again"), [("new", encode_messages([{"role": "user", "content": "x"}]))])
    assert _status(r, "again") == "running"
    assert isinstance(ended, EndedRow)


def test_an_outcome_already_there_never_drops_a_fresh_dispatch(redis_url):
    """Item 4: a stale delivery reads its prompt as failed; before it drops the in-flight
    entry, retry-failed puts the prompt back and a refill dispatches it to the same GPU. The old
    plain ZREM removed the fresh entry, and the id was in no set at all."""
    r = redis_lib.Redis.from_url(redis_url)
    book = _job(r, "fallout", 1)
    _outcomes(book, "fallout", completed=[], failed=[0])
    k = JobName("fallout")
    state = book.task_state(JobName("fallout"), "p0", GPU)                     # the stale message's read
    assert state.failed
    assert book.requeue_failed(JobName("fallout"), list(book.failed_records(JobName("fallout")))) == (1, 0)
    r.lpop(k.pending)
    r.zadd(k.inflight(GPU), {"p0": time.time()})                      # dispatched here again
    assert not window.drop_settled(r, JobName("fallout"), GPU, "p0")
    assert r.zscore(k.inflight(GPU), "p0") is not None
    # A prompt that does have its outcome leaves.
    r.zadd(k.inflight(GPU), {"px": 1})
    r.sadd(k.done, "px")
    assert window.drop_settled(r, JobName("fallout"), GPU, "px")


def test_update_job_is_a_compare_and_set(redis_url):
    r = redis_lib.Redis.from_url(redis_url)
    _job(r, "cas", 1)
    book = Ledger(r)
    job = jobs.load(r, JobName("cas"))
    assert book.transition(JobName("cas"), "running", "paused")
    wrong = book.update_job(JobName("cas"), job.as_read("status", "params"), {"params": "{}"})
    assert wrong == {"status": "paused"}
    assert jobs.load(r, JobName("cas")).params == job.params
    assert not book.transition(JobName("cas"), "running", "cancelled")
    assert book.update_job(JobName("gone"), {"status": ["running"]}, {"params": "{}"}) == {"status": ""}
    assert not r.exists(JobName("gone").config)


# -- real processes, held at a point -----------------------------------------------------------

def _hold(tmp_path: Path, point: str) -> tuple[Path, str]:
    gate = tmp_path / f"gate-{point}"
    gate.touch()
    return gate, f"{point}=hold:{gate}"


def _start_manage(c: Cluster, *args: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(python("manage.py", *args), env={**c.env, **env}, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_enqueue_never_undoes_a_cancel_or_a_set_made_while_it_loaded(tmp_path, cluster):
    """Item 3: a resume-enqueue (with --max-output-tokens 8192) is held after its dataset is
    stored, before it writes the job; meanwhile `set --max-output-tokens 2048` and `cancel`.
    Before, the enqueue wrote running and 8192 back. Now it is refused, says what changed, and
    the job stays cancelled at 2048, its new prompts stored and counted."""
    c = cluster()
    first = write_jsonl(tmp_path / "a.jsonl", prompts(5))
    c.manage("enqueue", "--dataset", str(first), "--job", "undo", "--max-output-tokens", "512")
    more = write_jsonl(tmp_path / "b.jsonl", prompts(8))
    gate, failpoint = _hold(tmp_path, "enqueue.before_apply")
    enqueue = _start_manage(c, "enqueue", "--dataset", str(more), "--job", "undo",
                            "--max-output-tokens", "8192", env={"DFLASH_FAILPOINTS": failpoint})
    wait_until(lambda: Path(f"{gate}.reached").exists(), timeout=60, what="enqueue held")
    c.manage("set", "--job", "undo", "--max-output-tokens", "2048")
    c.manage("cancel", "--job", "undo", "--yes")
    gate.unlink()
    out, err = enqueue.communicate(timeout=60)
    assert enqueue.returncode == 1, out + err
    assert "changed while this ran" in err and "status from running to cancelled" in err, err
    assert "3 new prompts are stored" in err and "Traceback" not in err, err
    job = jobs.load(c.r, JobName("undo"))
    assert job.status == "cancelled" and job.params.max_tokens == 2048
    assert int(c.r.hget(JobName("undo").counters, "total")) == 8


def test_set_loses_to_a_concurrent_set_and_says_so(tmp_path, cluster):
    c = cluster()
    data = write_jsonl(tmp_path / "a.jsonl", prompts(3))
    c.manage("enqueue", "--dataset", str(data), "--job", "sets", "--max-output-tokens", "512")
    c.manage("pause", "--job", "sets")
    gate, failpoint = _hold(tmp_path, "set.before_apply")
    slow = _start_manage(c, "set", "--job", "sets", "--max-output-tokens", "1024",
                         env={"DFLASH_FAILPOINTS": failpoint})
    wait_until(lambda: Path(f"{gate}.reached").exists(), timeout=60, what="set held")
    c.manage("set", "--job", "sets", "--temperature", "0.3")
    gate.unlink()
    out, err = slow.communicate(timeout=60)
    assert slow.returncode == 1 and "nothing was changed" in err, out + err
    params = json.loads(c.r.hget(JobName("sets").config, "params"))
    assert params["max_tokens"] == 512 and params["temperature"] == 0.3


def test_beat_held_before_done_while_retry_failed_lands(tmp_path, cluster):
    """Item 1 with real processes: beat is held just before it marks the job done (its final
    manifest and progress.json written); retry-failed puts the failed prompts back meanwhile.
    Released, beat must not mark it done; the job then finishes with every prompt generated."""
    c = cluster()
    c.start_server(0, "--context-length", "2048")
    c.start_worker(0)
    data = write_jsonl(tmp_path / "a.jsonl", prompts(6))
    # Every prompt fails at once: the cap exceeds the simulated server's context.
    c.manage("enqueue", "--dataset", str(data), "--job", "held", "--max-output-tokens", "4096")
    gate, failpoint = _hold(tmp_path, "tick.before_finish")
    c.env["DFLASH_FAILPOINTS"] = failpoint
    c.start_beat()
    wait_until(lambda: Path(f"{gate}.reached").exists(), timeout=120, what="beat held before done")
    assert c.status("held")["failed"] == 6
    c.manage("set", "--job", "held", "--max-output-tokens", "256")
    c.manage("retry-failed", "--job", "held", "--include-permanent")
    gate.unlink()
    snap = c.wait_done("held", timeout=180)
    assert snap["completed"] == 6 and snap["failed"] == 0
    assert len(c.rows("held")) == 6
