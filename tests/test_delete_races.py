"""`delete` against the commands that race it (issue 38): the job leaves Redis first, in one
compare-and-delete, and only then do its chunks of prompt bodies go, and only its own. Whoever
wins, the job is gone with every chunk of it, or it lives on with every chunk its prompts refer
to. The real commands (click's own parsing), in threads of this process started together, on
real Redis and local storage; failpoints widen the windows between a read and the write that
depends on it, and hold a deletion where a stale one would do harm."""
from __future__ import annotations

import shutil
import threading

import click
import pytest
import redis
from conftest import write_jsonl
from support import wait_until

from dflash_tasks.cli import cli
from dflash_tasks.core import jobs
from dflash_tasks.core.connections import redis_client
from dflash_tasks.core.keys import JobName
from dflash_tasks.core.settings import get_settings
from dflash_tasks.ingest import loader
from dflash_tasks.ledger import bodies, shared_ledger
from dflash_tasks.ledger.messages import decode_messages
from dflash_tasks.output.storage import LocalStorage

JOB = JobName("race")
ROUNDS = 15
WIDER = "sleep:0-0.03"  # a random pause: each round interleaves the commands differently
PROCESS_WIDE = (get_settings, redis_client, shared_ledger)  # cached once in a process


def rows(n: int) -> list[dict]:
    return [{"id": f"p{i}", "prompt": f"question {i} ✓"} for i in range(n)]


@pytest.fixture
def deployment(redis_url, tmp_path, monkeypatch):
    """This process's settings for the commands (fresh process-wide settings, client and ledger,
    and the previous ones back afterwards), and chunks of 10 prompts: a few dozen prompts make
    several chunks."""
    monkeypatch.setenv("DFLASH_REDIS_URL", redis_url)
    monkeypatch.setenv("DFLASH_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.setattr(loader, "CHUNK", 10)
    for cached in PROCESS_WIDE:
        cached.cache_clear()
    first = write_jsonl(tmp_path / "first.jsonl", rows(40))
    more = write_jsonl(tmp_path / "more.jsonl", rows(70))  # the first 40 and 30 new ones
    yield redis.Redis.from_url(redis_url), tmp_path / "out", first, more
    monkeypatch.undo()
    for cached in PROCESS_WIDE:
        cached.cache_clear()


def failpoints(monkeypatch, value: str) -> None:
    monkeypatch.setenv("DFLASH_FAILPOINTS", value)
    get_settings.cache_clear()


def manage(*args: str) -> str | None:
    """A manage.py command run in this thread: None when it succeeded, else its error message."""
    try:
        cli.main(list(args), prog_name="manage.py", standalone_mode=False)
    except click.ClickException as exc:
        return exc.format_message()
    return None


def together(*commands: tuple[str, ...]) -> list[str | None]:
    """The commands run in threads released at the same moment; what manage() said of each."""
    start, said, crashed = threading.Barrier(len(commands)), {}, []

    def run(i: int, args: tuple[str, ...]) -> None:
        start.wait()
        try:
            said[i] = manage(*args)
        except BaseException as exc:  # a bug: the test fails with it
            crashed.append(exc)

    threads = [threading.Thread(target=run, args=(i, args)) for i, args in enumerate(commands)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if crashed:
        raise crashed[0]
    assert len(said) == len(commands), "a command did not end"
    return [said[i] for i in range(len(commands))]


def paused_job(r, out, dataset) -> None:
    r.flushdb()
    shutil.rmtree(out, ignore_errors=True)
    assert manage("enqueue", "--dataset", str(dataset), "--job", JOB, "--bodies", "storage") is None
    assert manage("pause", "--job", JOB) is None
    assert len(chunk_files(out)) == 4


def chunk_files(out) -> list[str]:
    return sorted(p.name for p in (out / JOB / bodies.BODIES_DIR).glob("chunk-*.zst"))


def whole_or_gone(r, out) -> str:
    """The invariant: the job gone and every chunk of it too, or the job there and every prompt
    it holds readable from its chunk, its own text. Returns which."""
    if jobs.load(r, JOB) is None:
        assert chunk_files(out) == [], "the job is gone but chunks of it are left"
        assert not list(r.scan_iter(match=JOB.every_key))
        return "gone"
    stored = r.hgetall(JOB.prompts)
    assert len(stored) >= 40
    storage = LocalStorage(out)
    for pid, ref in stored.items():
        assert bodies.is_reference(ref), pid
        messages = decode_messages(bodies.read_frame(storage, JOB, ref))  # raises if it is gone
        assert messages == [{"role": "user", "content": f"question {pid.decode()[1:]} ✓"}]
    return "lives"


def test_delete_raced_by_resume_leaves_the_job_whole_or_gone(deployment, monkeypatch):
    """Before: delete removed the chunks, then lost its compare-and-delete to the resume, and
    the job ran on with its prompt bodies gone, every prompt failing prompt_body_missing."""
    r, out, first, _ = deployment
    failpoints(monkeypatch, f"delete.before_apply={WIDER},delete.before_chunks={WIDER},"
                            f"state.before_apply={WIDER}")
    for _ in range(ROUNDS):
        paused_job(r, out, first)
        deleted, resumed = together(("delete", "--job", JOB, "--yes"), ("resume", "--job", JOB))
        outcome = whole_or_gone(r, out)
        # Exactly one of them did what it was asked, and the other says nothing was changed.
        assert (deleted is None) == (outcome == "gone") != (resumed is None), (deleted, resumed)
        if outcome == "lives":
            assert "nothing was deleted" in deleted or "is running" in deleted, deleted
            assert jobs.load(r, JOB).status == "running"


def test_delete_raced_by_enqueue_leaves_the_job_whole_or_gone(deployment, monkeypatch):
    """An enqueue adds chunks to the paused job, or (the delete first) makes a new job of the
    same name, numbering its chunks after the deleted job's: the deletion removes none of
    them, whenever its removal comes."""
    r, out, first, more = deployment
    failpoints(monkeypatch, f"delete.before_apply={WIDER},delete.before_chunks={WIDER}")
    for _ in range(ROUNDS):
        paused_job(r, out, first)
        deleted, enqueued = together(
            ("delete", "--job", JOB, "--yes"),
            ("enqueue", "--dataset", str(more), "--job", JOB, "--bodies", "storage"))
        assert deleted is None, deleted  # a paused job stays paused through an enqueue
        outcome = whole_or_gone(r, out)
        if outcome == "lives":  # a new job, made after the deletion, with every prompt
            assert enqueued is None and len(r.hgetall(JOB.prompts)) == 70, enqueued


def test_a_deletion_held_after_redis_leaves_a_new_job_of_its_name_its_chunks(deployment,
                                                                            monkeypatch, tmp_path):
    """The deletion's removal of chunks comes after a new job of the same name stored its own
    (a slow storage, a command paused): it removes the deleted job's four chunks, none of the
    new job's seven."""
    r, out, first, more = deployment
    paused_job(r, out, first)
    gate = tmp_path / "gate"
    gate.touch()
    failpoints(monkeypatch, f"delete.before_chunks=hold:{gate}")
    said = []
    deleting = threading.Thread(target=lambda: said.append(manage("delete", "--job", JOB, "--yes")),
                                daemon=True)
    deleting.start()
    try:
        wait_until(lambda: (tmp_path / "gate.reached").exists(), timeout=60,
                   what="the deletion held between Redis and the storage")
        assert jobs.load(r, JOB) is None
        made = manage("enqueue", "--dataset", str(more), "--job", JOB, "--bodies", "storage")
        assert made is None and chunk_files(out) == [f"chunk-{n:06d}.zst" for n in range(1, 12)]
    finally:
        gate.unlink()
    deleting.join(timeout=60)
    assert said == [None]
    assert chunk_files(out) == [f"chunk-{n:06d}.zst" for n in range(5, 12)]
    assert whole_or_gone(r, out) == "lives"


def test_chunk_numbers_go_on_past_a_deleted_job_and_only_its_own_chunks_go(redis_url, tmp_path):
    """A job of a name numbers its chunks after every earlier job of that name, one numbered in
    its config alone (before the counter that outlives jobs) included; the removal takes the
    deleted job's numbers and leaves a later job's, and whatever is not a chunk."""
    r = redis.Redis.from_url(redis_url)

    def new_job(name: JobName, numbered_alone: int = 0) -> None:
        jobs.save(r, name, jobs.GenerationParams(), selection=jobs.GpuSelection(), dataset="d")
        jobs.body_location(r, name, wanted=str(tmp_path))
        if numbered_alone:
            r.hset(name.config, "body_chunks", numbered_alone)

    name = JobName("named")
    new_job(name, numbered_alone=5)
    assert jobs.next_body_chunk(r, name) == 6
    gone = jobs.delete(r, name)
    assert (gone.bodies, gone.chunks_through) == (str(tmp_path), 6)
    new_job(name)
    assert [jobs.next_body_chunk(r, name) for _ in range(2)] == [7, 8]
    old = JobName("old")
    new_job(old, numbered_alone=9)
    assert jobs.delete(r, old).chunks_through == 9
    new_job(old)
    assert jobs.next_body_chunk(r, old) == 10

    storage = LocalStorage(tmp_path)
    for chunk in (1, 6, 7, 8):
        storage.put(bodies.chunk_key(name, chunk), b"frames")
    storage.put(f"{name}/prompts/.chunk-000009.zst.tmp", b"being written")
    storage.put(f"{name}x/prompts/chunk-000001.zst", b"another job's")
    assert bodies.remove_chunks(storage, name, gone.chunks_through) == 2
    assert storage.list(f"{name}/prompts/") == [f"{name}/prompts/.chunk-000009.zst.tmp",
                                                f"{name}/prompts/chunk-000007.zst",
                                                f"{name}/prompts/chunk-000008.zst"]
    assert storage.exists(f"{name}x/prompts/chunk-000001.zst")
