"""The job lifecycle (dflash_tasks/core/lifecycle.py) through manage.py, against a real Redis: every
command refused in a state that does not allow it changes nothing; a failed enqueue leaves no
job behind; cancel keeps every prompt counted, so resume finishes them all."""
from __future__ import annotations

import gzip
import json

import pytest
from conftest import Cluster, write_jsonl
from support import wait_until

JOB = "life"


def prompts(n: int, start: int = 0) -> list[dict]:
    return [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}"}]}
            for i in range(start, start + n)]


@pytest.fixture
def c(tmp_path, redis_url):
    # No workers: these tests look at the books, not at generation.
    return Cluster(tmp_path, redis_url)


def job_keys(c: Cluster, job: str = JOB) -> list[bytes]:
    return list(c.r.scan_iter(match=f"dflash:\\{{{job}\\}}:*"))


def status(c: Cluster) -> str:
    return c.r.hget(f"dflash:{{{JOB}}}:config", "status").decode()


def refused(c: Cluster, *args: str) -> str:
    result = c.manage(*args, check=False)
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr


def test_commands_refused_in_states_that_do_not_allow_them(c, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", prompts(30))
    c.manage("enqueue", "--dataset", str(data), "--job", JOB)
    assert status(c) == "running"
    assert "is running" in refused(c, "resume", "--job", JOB)
    assert "is running" in refused(c, "delete", "--job", JOB, "--yes")

    c.manage("pause", "--job", JOB)
    assert "is paused" in refused(c, "pause", "--job", JOB)
    # enqueue on a paused job adds prompts and leaves it paused (it used to un-pause it)
    more = write_jsonl(tmp_path / "more.jsonl", prompts(40))
    out = c.manage("enqueue", "--dataset", str(more), "--job", JOB)
    assert "stays paused" in out.stderr
    assert status(c) == "paused"
    assert c.status(JOB)["total"] == 40

    # done (as beat marks it): pause, resume and cancel are refused and change nothing
    c.r.hset(f"dflash:{{{JOB}}}:config", "status", "done")
    for command in ("pause", "resume"):
        err = refused(c, command, "--job", JOB)
        assert "is done" in err and "retry-failed" in err
    refused(c, "cancel", "--job", JOB, "--yes")
    assert status(c) == "done"
    # an enqueue that adds nothing leaves a done job done
    c.manage("enqueue", "--dataset", str(more), "--job", JOB)
    assert status(c) == "done"


def test_cancel_keeps_every_prompt_and_resume_finishes_them(c, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", prompts(50))
    c.manage("enqueue", "--dataset", str(data), "--job", JOB)
    out = c.manage("cancel", "--job", JOB, "--yes")
    snap = c.status(JOB)
    assert snap["status"] == "cancelled" and snap["total"] == 50
    never = snap["pending"]
    assert never > 0 and f"{never:,} never started" in out.stdout, out.stdout
    assert f"{snap['total'] - snap['completed'] - snap['failed']:,} prompts have no row" in out.stdout
    assert snap["eta_hours"] is None
    assert snap["pending"] + snap["in_flight"] + snap["completed"] + snap["failed"] == 50
    assert "is cancelled" in refused(c, "enqueue", "--dataset", str(data), "--job", JOB)
    c.manage("resume", "--job", JOB)
    snap = c.status(JOB)
    assert snap["status"] == "running" and snap["total"] == 50
    assert snap["pending"] + snap["in_flight"] == 50


@pytest.mark.parametrize("name,content", [
    ("missing.jsonl", None),
    ("prompts.txt", b'{"id": "a", "messages": [{"role": "user", "content": "x"}]}\n'),
    ("empty.jsonl", b""),
    ("invalid.jsonl", b"not json\n{\"id\": 3}\n"),
    ("corrupt.jsonl.zst", b"\x28\xb5\x2f\xfd garbage"),
    ("corrupt.parquet", b"PAR1 not a parquet file"),
    ("truncated.jsonl.gz", None),
])
def test_a_failed_enqueue_leaves_no_job(c, tmp_path, name, content):
    path = tmp_path / name
    if name == "truncated.jsonl.gz":  # cut before its first chunk of 1,000 prompts is stored
        whole = gzip.compress("".join(json.dumps(p) + "\n" for p in prompts(3000)).encode())
        path.write_bytes(whole[:200])
    elif content is not None:
        path.write_bytes(content)
    err = refused(c, "enqueue", "--dataset", str(path), "--job", JOB)
    assert name in err and "not created" in err, err
    assert job_keys(c) == [] and not c.r.sismember("dflash:jobs", JOB)


def test_a_new_job_dispatches_from_its_first_chunk_and_keeps_it_whatever_follows(c, tmp_path):
    """Issue 29: the GPUs do not wait for the whole dataset: a new job runs from its first stored
    chunk of 1,000 prompts. A dataset that turns out unreadable after that keeps the job, running,
    with every prompt read before the error (2 whole chunks: they are being generated), and says
    so; enqueueing the fixed dataset again adds the rest."""
    rows = prompts(3000)
    whole = gzip.compress("".join(json.dumps(p) + "\n" for p in rows).encode())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[: len(whole) * 3 // 4])
    err = refused(c, "enqueue", "--dataset", str(cut), "--job", JOB)
    assert "cannot read past line 2242" in err and f"job {JOB} kept its 2,000" in err, err
    snap = c.status(JOB)
    assert snap["status"] == "running" and snap["total"] == 2000
    assert "stopped by an error (DatasetError) after 2,000 new prompts" in snap["incomplete"]
    fixed = tmp_path / "fixed.jsonl.gz"
    fixed.write_bytes(whole)
    c.manage("enqueue", "--dataset", str(fixed), "--job", JOB)
    snap = c.status(JOB)
    assert snap["total"] == 3000 and snap["incomplete"] is None


def test_a_failed_resume_keeps_the_job_as_it_was(c, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", prompts(20))
    c.manage("enqueue", "--dataset", str(data), "--job", JOB, "--max-output-tokens", "1000")
    before = c.status(JOB)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    err = refused(c, "enqueue", "--dataset", str(empty), "--job", JOB, "--max-output-tokens", "9")
    assert "unchanged" in err
    after = c.status(JOB)
    assert (after["total"], after["status"]) == (before["total"], before["status"])
    config = c.r.hget(f"dflash:{{{JOB}}}:config", "params")
    assert json.loads(config)["max_tokens"] == 1000


def test_delete_removes_every_key_and_keeps_other_jobs(c, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", prompts(20))
    c.manage("enqueue", "--dataset", str(data), "--job", JOB)
    c.manage("enqueue", "--dataset", str(data), "--job", "other")
    c.manage("cancel", "--job", JOB, "--yes")
    out = c.manage("delete", "--job", JOB, "--yes")
    assert "deleted" in out.stdout
    assert job_keys(c) == [] and not c.r.sismember("dflash:jobs", JOB)
    assert c.status("other")["total"] == 20
    assert "no job named" in refused(c, "status", "--job", JOB)


def test_fewer_gpus_on_a_resume_moves_their_prompts_to_the_gpus_kept(c, tmp_path):
    # Four GPUs whose workers registered and beat now (no worker consumes: their windows stay
    # in flight), so the enqueue fills all four.
    seconds, _ = c.r.time()
    for gpu in range(4):
        c.r.hset("dflash:workers", c.gpu(gpu), json.dumps({"concurrency": 8}))
        c.r.hset("dflash:workers:seen", c.gpu(gpu), seconds + 3600)
    inflight = {gpu: f"dflash:{{{JOB}}}:inflight:{c.gpu(gpu)}" for gpu in range(4)}
    data = write_jsonl(tmp_path / "d.jsonl", prompts(400))
    c.manage("enqueue", "--dataset", str(data), "--job", JOB, "--gpus", "4")
    stranded = c.r.zcard(inflight[2]) + c.r.zcard(inflight[3])
    assert stranded == 2 * 12  # two windows of 8 x 1.5
    out = c.manage("enqueue", "--dataset", str(data), "--job", JOB, "--gpus", "2")
    assert f"{stranded:,} prompts in flight" in out.stdout
    for gpu in (2, 3):
        assert c.r.zcard(inflight[gpu]) == 0
        assert c.r.llen(c.gpu(gpu)) == 0  # their messages are gone from the queues
    assert c.r.zcard(inflight[0]) == c.r.zcard(inflight[1]) == 12
    snap = c.status(JOB)
    assert snap["pending"] + snap["in_flight"] == snap["total"] == 400
    assert set(snap["gpus"]) == {c.gpu(g) for g in range(4)}  # the dropped ones still shown


def test_beat_survives_a_bad_job_name(tmp_path, redis_url):
    c = Cluster(tmp_path, redis_url, allow_no_persistence="1")
    try:
        data = write_jsonl(tmp_path / "d.jsonl", prompts(5))
        c.manage("enqueue", "--dataset", str(data), "--job", JOB)
        c.r.sadd("dflash:jobs", "bad name!", b"\xff\xfe")
        c.start_beat()
        progress = c.output_dir / JOB / "progress.json"
        wait_until(progress.exists, timeout=90, what="beat to write the good job's progress.json")
        first = progress.stat().st_mtime
        wait_until(lambda: progress.stat().st_mtime > first, timeout=30,
                   what="a second tick despite the bad names")
        assert "skipped this time" in c.beat.log()
    finally:
        c.stop()
