"""regenerate finds its rows through the ledger's index of rows by finish reason, so its cost
follows the rows it takes back: a plain regenerate reads no batch (proved by deleting them
all), `--continue` reads only the batches that hold the rows it continues (the others deleted;
in process, each read counted), also while they wait in beat's spool during an S3 outage. The
index follows every change of a row's status, and a job without it is still regenerated.

The ledger's own scripts on a real Redis build the job's state; the real CLI (manage.py, a
subprocess) regenerates it."""
from __future__ import annotations

import json

import redis as redis_lib
from conftest import Cluster
from s3support import AWS_ENV
from support import free_port
from test_spool import CutRemote

from dflash_tasks.core import jobs
from dflash_tasks.core.keys import JobName
from dflash_tasks.ledger import EndedRow, Ledger, bodies
from dflash_tasks.ledger.messages import decode_messages, encode_messages
from dflash_tasks.output.batches import BatchPolicy, BatchWriter, batch_key, rows_at
from dflash_tasks.output.spool import Spool
from dflash_tasks.output.storage import LocalStorage

GPU = "gpu0@a"
CUT_AT = 32       # the cap the truncated rows were cut at
CAP = 64          # the job's cap now: room to continue them
N = 60            # prompts: 5 batches of 10 sealed, 10 rows left in the stream
# Truncated rows only in batches 1 and 3 and in the stream: batches 0, 2 and 4 hold none.
TRUNCATED = {12, 15, 31, 52, 55}


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"question {i}"}]


def _row(i: int, reason: str) -> dict:
    out = CUT_AT if reason == "length" else 5 + i % 7
    return {"id": f"p{i:03d}",
            "conversations": [*_messages(i), {"role": "assistant", "content": f"answer {i}",
                                              "reasoning_content": None}],
            "status": "truncated" if reason == "length" else "success",
            "metadata": {"finish_reason": reason, "prompt_tokens": 3 + i % 5,
                         "completion_tokens": out, "reasoning_tokens": 0, "gpu": GPU,
                         "enable_thinking": False, "latency_s": 0.5, "attempts": 1,
                         "completed_at": 1_700_000_000 + i},
            "token_ids": {"prompt": [1, 2, i], "response": list(range(i, i + out))}}


def _build(r, job: str, storage, spool: Spool | None = None) -> Ledger:
    """A job as a run leaves it: every prompt done, 50 rows sealed in 5 batches (to the storage,
    or to the spool while it is cut), 10 still waiting in the stream."""
    job = JobName(job)
    book = Ledger(r)
    jobs.save(r, job, jobs.GenerationParams(max_tokens=CAP),
              selection=jobs.GpuSelection.parse("all"), dataset="x", status="running")
    book.add_prompts(job, [(f"p{i:03d}", encode_messages(_messages(i))) for i in range(N)])
    writer = BatchWriter(r, book, storage, BatchPolicy(rows=10, bytes=10**9, max_age_s=10**6),
                         spool=spool)
    for i in range(N):
        assert book.complete(job, f"p{i:03d}", GPU, _row(i, "length" if i in TRUNCATED else "stop"))
        if i == 49:
            assert len(writer.flush(job, final=True)) == 5
    return book


def _counters(r, job: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in r.hgetall(JobName(job).counters).items()}


def _assert_taken_back(r, job: str, *, continued: bool) -> None:
    """Exactly the truncated prompts are back in pending, with their own prompt (and their own
    output to continue); their done marks, index records and counter shares are gone."""
    k = JobName(job)
    ids = {f"p{i:03d}" for i in TRUNCATED}
    assert {p.decode() for p in r.lrange(k.pending, 0, -1)} == ids
    assert not ids & {d.decode() for d in r.smembers(k.done)}
    assert r.scard(k.done) == N - len(TRUNCATED) and r.hlen(k.ended("length")) == 0
    for i in TRUNCATED:
        stored = r.hget(k.prompts, f"p{i:03d}")
        if continued:  # the entry is on the job's storage, Redis holds its reference (issue 28)
            assert bodies.is_reference(stored) and len(stored) < 32, stored
            location = r.hget(k.config, "bodies").decode()
            stored = bodies.read_frame(LocalStorage(location), job, stored)
        entry = decode_messages(stored)
        if continued:
            assert entry["messages"] == _messages(i)
            assert entry["continue"]["response_ids"] == _row(i, "length")["token_ids"]["response"]
        else:
            assert entry == _messages(i)
    c = _counters(r, job)
    assert c["completed"] == N - len(TRUNCATED) and c["finish:length"] == 0
    assert c["output_tokens"] == sum(_row(i, "stop")["metadata"]["completion_tokens"]
                                     for i in range(N) if i not in TRUNCATED)


def test_plain_regenerate_reads_no_batch(tmp_path, redis_url):
    c = Cluster(tmp_path, redis_url)
    _build(c.r, "plain", LocalStorage(c.output_dir))
    batches = sorted((c.output_dir / "plain" / "batches").iterdir())
    assert len(batches) == 5
    for path in batches:  # nothing to read: the index must be enough
        path.unlink()
    out = c.manage("regenerate", "--job", "plain", "--finish-reason", "length").stdout
    assert f"{len(TRUNCATED)} prompts with finish_reason 'length' queued again" in out, out
    assert "reading every batch" not in out
    _assert_taken_back(c.r, "plain", continued=False)
    # Run again: nothing left to take (a prompt taken back is no longer done).
    again = c.manage("regenerate", "--job", "plain", "--finish-reason", "length").stdout
    assert "0 prompts" in again


def test_continue_reads_only_the_batches_holding_the_rows(tmp_path, redis_url):
    c = Cluster(tmp_path, redis_url)
    _build(c.r, "cont", LocalStorage(c.output_dir))
    names = sorted(json.loads(v)["name"] for v in c.r.hvals(JobName("cont").manifest))
    for i in (0, 2, 4):  # no truncated row there: reading one would fail
        (c.output_dir / batch_key("cont", names[i])).unlink()
    out = c.manage("regenerate", "--job", "cont", "--finish-reason", "length", "--continue").stdout
    assert f"{len(TRUNCATED)} continue from their truncated output: " \
           f"{len(TRUNCATED) * CUT_AT} tokens reused" in out, out
    _assert_taken_back(c.r, "cont", continued=True)


def test_each_batch_holding_rows_is_read_once(tmp_path, redis_url):
    r = redis_lib.Redis.from_url(redis_url)

    class Counting(LocalStorage):
        def __init__(self, root):
            super().__init__(root)
            self.reads: list[str] = []

        def get(self, key: str) -> bytes:
            self.reads.append(key)
            return super().get(key)

    storage = Counting(tmp_path / "out")
    book = _build(r, "once", storage)
    storage.reads.clear()
    truncated = list(book.ended_rows(JobName("once"), "length", prompts=False))
    assert sorted(e.id for e in truncated) == sorted(f"p{i:03d}" for i in TRUNCATED)
    assert storage.reads == []  # finding them read nothing
    found = dict(rows_at(r, storage, JobName("once"), [(e.entry, e.id) for e in truncated]))
    assert found == {f"p{i:03d}": _row(i, "length") for i in TRUNCATED}
    names = sorted(json.loads(v)["name"] for v in r.hvals(JobName("once").manifest))
    assert storage.reads == [batch_key("once", names[1]), batch_key("once", names[3])]


def test_regenerate_during_an_s3_outage_reads_the_spool(tmp_path, redis_url):
    """Every batch went to beat's spool (S3 cut from the start); S3 still does not answer
    while regenerate runs: a plain one needs nothing from it. --continue reads the rows from the
    spool, but their prefixes go to chunks on S3 (issue 28: not into Redis), so it says it
    needs the storage and takes nothing back."""
    c = Cluster(tmp_path, redis_url, s3_uri="s3://dflash-test/runs")
    c.env.update({**AWS_ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"})  # no one there
    spool = Spool(c.output_dir / ".spool")  # the settings' default: the CLI looks there
    for job in ("outage", "outage-cont"):
        cut = CutRemote(tmp_path / "s3")
        cut.down = True
        _build(c.r, job, cut, spool)
        assert len(spool.names(job)) == 5 and not (tmp_path / "s3" / job).exists()
    out = c.manage("regenerate", "--job", "outage", "--finish-reason", "length").stdout
    assert f"{len(TRUNCATED)} prompts with finish_reason 'length' queued again" in out, out
    _assert_taken_back(c.r, "outage", continued=False)
    result = c.manage("regenerate", "--job", "outage-cont", "--finish-reason", "length",
                      "--continue", check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "prompts/chunk-000001.zst" in result.stderr and "once the storage answers" in result.stderr
    assert "0 prompts were queued again" in result.stderr
    assert c.r.hlen(JobName("outage-cont").ended("length")) == len(TRUNCATED)  # nothing taken back


def test_a_spooled_batch_this_machine_does_not_hold_is_named(tmp_path, redis_url):
    c = Cluster(tmp_path, redis_url, s3_uri="s3://dflash-test/runs")
    c.env.update({**AWS_ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"})
    cut = CutRemote(tmp_path / "s3")
    cut.down = True
    _build(c.r, "far", cut, Spool(tmp_path / "beats-own-disk"))
    result = c.manage("regenerate", "--job", "far", "--finish-reason", "length", "--continue",
                      check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "waits in beat's spool" in result.stderr
    assert "run the same command again" in result.stderr
    assert "0 prompts were queued again" in result.stderr
    assert c.r.hlen(JobName("far").ended("length")) == len(TRUNCATED)  # nothing taken back


def test_the_index_follows_every_change_of_a_rows_status(redis_url, tmp_path):
    r = redis_lib.Redis.from_url(redis_url)
    book = _build(r, "moves", LocalStorage(tmp_path / "out"))
    k = JobName("moves")

    def indexed() -> set[str]:
        return {i.decode() for i in r.hkeys(k.ended("length"))}

    assert indexed() == {f"p{i:03d}" for i in TRUNCATED} and not r.exists(k.ended("stop"))
    # A duplicate delivery of a done prompt changes nothing.
    assert not book.complete(JobName("moves"), "p012", GPU, _row(12, "stop"))
    assert "p012" in indexed()
    # Regenerated: out of the index; done again, under the reason its new row ended with.
    e12, e15, e31 = (next(e for e in book.ended_rows(JobName("moves"), "length") if e.id == p)
                     for p in ("p012", "p015", "p031"))
    for e in (e12, e15, e31):
        assert book.reopen(JobName("moves"), e, e.prompt, 0)
    assert indexed() == {"p052", "p055"}
    assert book.complete(JobName("moves"), "p012", GPU, _row(12, "stop"))
    assert book.complete(JobName("moves"), "p015", GPU, _row(15, "length"))
    new15 = next(e for e in book.ended_rows(JobName("moves"), "length") if e.id == "p015")
    assert new15.entry != e15.entry and indexed() == {"p015", "p052", "p055"}
    # The record regenerate read is stale now (p015 was done again since): not taken back.
    assert not book.reopen(JobName("moves"), e15, e15.prompt, 0) and "p015" in indexed()
    # A reopened prompt that fails is in no index; retried, it is indexed when it finishes.
    assert book.fail(JobName("moves"), "p031", GPU, {"reason": "http_400"})
    assert "p031" not in indexed()
    assert book.requeue_failed(JobName("moves"), list(book.failed_records(JobName("moves")))) == (1, 0)
    assert book.complete(JobName("moves"), "p031", GPU, _row(31, "length"))
    assert indexed() == {"p015", "p031", "p052", "p055"}
    c = _counters(r, "moves")
    assert c["finish:length"] == r.hlen(k.ended("length")) == 4
    assert book.ended_count(JobName("moves"), "length") == (4, 4)
    # Delete takes the index with every other key of the job.
    jobs.delete(r, JobName("moves"))
    assert not list(r.scan_iter(match=k.every_key))


def test_rows_finished_after_the_index_is_read_are_not_taken(redis_url, tmp_path):
    r = redis_lib.Redis.from_url(redis_url)
    book = _build(r, "late", LocalStorage(tmp_path / "out"))
    taken = book.ended_rows(JobName("late"), "length")
    first = next(taken)  # the stream's last entry is read here
    assert book.reopen(JobName("late"), first, first.prompt, 0)
    i = int(first.id[1:])
    assert book.complete(JobName("late"), first.id, GPU, _row(i, "length"))  # done again, indexed again
    rest = list(taken)
    assert first.id not in {e.id for e in rest} and len(rest) == len(TRUNCATED) - 1


def test_a_job_without_the_index_is_regenerated_by_reading_every_batch(tmp_path, redis_url):
    c = Cluster(tmp_path, redis_url)
    _build(c.r, "old", LocalStorage(c.output_dir))
    c.r.delete(JobName("old").ended("length"))  # as a version before the index left it
    out = c.manage("regenerate", "--job", "old", "--finish-reason", "length").stdout
    assert "holds 0 of the 5 rows that ended 'length'" in out and "reading every batch" in out
    assert f"{len(TRUNCATED)} prompts with finish_reason 'length' queued again" in out
    k = JobName("old")
    pending = {p.decode() for p in c.r.lrange(k.pending, 0, -1)}
    assert pending == {f"p{i:03d}" for i in TRUNCATED}
    assert _counters(c.r, "old")["finish:length"] == 0
    # Stop rows are not indexed: found the same way, and said so.
    out = c.manage("regenerate", "--job", "old", "--finish-reason", "stop", "--limit", "3").stdout
    assert "'stop' are most of a job and not indexed" in out and "3 prompts" in out


def test_the_index_keeps_the_entry_the_task_read_and_encodes_a_continued_one(redis_url):
    """The worker hands complete() the `prompts` entry it read when that entry is the prompt
    alone, so the index keeps those very bytes (nothing encoded again); an entry that carries a
    continuation is not the prompt alone, and the row's messages are encoded instead."""
    r = redis_lib.Redis.from_url(redis_url)
    book = Ledger(r)
    jobs.save(r, JobName("kept"), jobs.GenerationParams(max_tokens=CAP),
              selection=jobs.GpuSelection.parse("all"), dataset="x", status="running")
    k = JobName("kept")
    book.add_prompts(JobName("kept"), [("p012", encode_messages(_messages(12)))])
    stored = r.hget(k.prompts, "p012")
    state = book.task_state(JobName("kept"), "p012", GPU)
    assert state.bare_entry == stored and state.continuation is None
    assert book.complete(JobName("kept"), "p012", GPU, _row(12, "length"), bare_entry=state.bare_entry)
    ended = next(book.ended_rows(JobName("kept"), "length"))
    assert ended.prompt == stored

    continued = {"messages": _messages(12), "continue": {"prompt_ids": [1, 2, 12],
                                                         "response_ids": list(range(12, 12 + CUT_AT))}}
    assert book.reopen(JobName("kept"), ended, json.dumps(continued), CUT_AT)
    state = book.task_state(JobName("kept"), "p012", GPU)
    assert state.bare_entry is None and state.continuation is not None
    assert book.complete(JobName("kept"), "p012", GPU, _row(12, "length"), bare_entry=state.bare_entry)
    assert decode_messages(next(book.ended_rows(JobName("kept"), "length")).prompt) == _messages(12)


def test_a_row_of_no_tokens_and_a_share_of_none_are_taken_back(redis_url):
    """A share of no tokens (a generation moved before its first token) and a row of none are
    taken back like any other: Lua's -0 would reach HINCRBY as "-0", which Redis refuses (a chaos
    sequence's regenerate crashed on it)."""
    r = redis_lib.Redis.from_url(redis_url)
    book, k = Ledger(r), JobName("zero")
    jobs.save(r, k, jobs.GenerationParams(max_tokens=CAP),
              selection=jobs.GpuSelection.parse("all"), dataset="x", status="running")
    book.add_prompts(k, [(f"p{i:03d}", encode_messages(_messages(i))) for i in (1, 2)])
    moved = _row(1, "length")
    moved["metadata"]["gpus"] = [{"gpu": "gpu1@b", "tokens": 0, "seconds": 0.2},
                                 {"gpu": GPU, "tokens": CUT_AT, "seconds": 1.0}]
    empty = _row(2, "stop")
    empty["metadata"]["completion_tokens"], empty["token_ids"]["response"] = 0, []
    assert book.complete(k, "p001", GPU, moved) and book.complete(k, "p002", GPU, empty)
    ended = next(book.ended_rows(k, "length"))  # through the index
    assert book.reopen(k, ended, ended.prompt, 0)
    # a row read from its batch (rows that stop are not indexed)
    assert book.reopen(k, EndedRow.from_row(empty), encode_messages(_messages(2)), 0)
    c = _counters(r, "zero")
    assert c["completed"] == c["output_tokens"] == 0 and r.scard(k.done) == 0
    assert c[f"gpu:{GPU}:output_tokens"] == c["gpu:gpu1@b:output_tokens"] == 0
