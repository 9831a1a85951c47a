"""Bounded Redis whatever fails: during an S3 outage sealed batches go to beat's local spool and
leave Redis, and go up in order, exactly once, when S3 answers again; when the spool's disk is
full too, dispatch is held instead of Redis filling; near Redis's maxmemory, dispatch is held.

In process (real Redis, a storage that can be cut, every step of the protocol crashed once), then
a whole run against moto's S3 server with workers and beat."""
from __future__ import annotations

import errno
import json
import os
import re
from collections import Counter

import pytest
import redis as redis_lib
import zstandard
from s3support import TcpProxy, assert_shipped_exactly_once, s3_cluster, storage
from support import wait_until
from test_pipeline import SIM_ARGS, dataset

from dflash_tasks.core import jobs
from dflash_tasks.core.keys import MEMORY_HOLD, JobName
from dflash_tasks.core.settings import Settings
from dflash_tasks.dispatch import window
from dflash_tasks.ledger import Ledger
from dflash_tasks.output import sealing
from dflash_tasks.output.batches import SPOOLED, BatchPolicy, BatchWriter, read_batch, read_manifest
from dflash_tasks.output.spool import Spool
from dflash_tasks.output.storage import LocalStorage, StorageError

JOB = JobName("spool")
GPU = "gpu0@a"


class CutRemote(LocalStorage):
    """A remote storage (counted as S3) that a test can cut: every put then fails as S3's do."""
    is_remote = True
    down = False

    def put(self, key: str, data: bytes) -> None:
        if self.down:
            raise StorageError(f"S3 upload {self.location(key)} failed: EndpointConnectionError")
        super().put(key, data)


class Crash(BaseException):
    """A beat dying right after a step: nothing in the writer catches it."""


@pytest.fixture
def r(redis_url):
    return redis_lib.Redis.from_url(redis_url)


def _job(r, n: int) -> Ledger:
    book = Ledger(r)
    jobs.save(r, JOB, jobs.GenerationParams(), selection=jobs.GpuSelection.parse("all"),
              dataset="x", status="running")
    book.add_prompts(JOB, [(f"p{i:04d}", "[]") for i in range(n)])
    return book


def _complete(book: Ledger, ids) -> None:
    for i in ids:
        book.complete(JOB, f"p{i:04d}", GPU, {
            "id": f"p{i:04d}", "conversations": [], "status": "success", "metadata": {
                "finish_reason": "stop", "prompt_tokens": 10, "completion_tokens": 20, "gpu": GPU,
                "latency_s": 1.0, "attempts": 1, "completed_at": 1_700_000_000 + i,
                "pad": "x" * 2000}})


def _writer(r, book, tmp_path, store=None, spool_root=None) -> BatchWriter:
    return BatchWriter(r, book, store or CutRemote(tmp_path / "s3"),
                       BatchPolicy(rows=50, bytes=10**9, max_age_s=10**6), lock_ttl_s=5,
                       spool=Spool(spool_root or tmp_path / "spool"))


def _shipped(r, writer) -> tuple[dict, list[str]]:
    """manifest.json as the storage holds it, and its rows' ids in order, each batch verified."""
    manifest = read_manifest(writer.storage, JOB)
    return manifest, [row["id"] for rec in manifest["batches"] for row in read_batch(writer.storage, rec)]


def _counters(r) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in r.hgetall(JobName(JOB).counters).items()}


def _crash_after(monkeypatch, cls, method: str, when=lambda *a, **k: True) -> None:
    """cls.method runs, then raises Crash, the first time `when` says so."""
    original = getattr(cls, method)
    fired = []

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        if not fired and when(*args, **kwargs):
            fired.append(method)
            raise Crash(method)
        return result

    monkeypatch.setattr(cls, method, wrapper)


def test_an_outage_spools_every_batch_and_ships_them_in_order_once_s3_answers(r, tmp_path):
    book = _job(r, 500)
    writer = _writer(r, book, tmp_path)
    writer.storage.down = True
    k = JobName(JOB)
    for round_ in range(10):  # ten batches sealed during the outage: Redis keeps none of them
        _complete(book, range(50 * round_, 50 * round_ + 50))
        assert writer.flush(JOB) and isinstance(writer.storage_failure, StorageError)
        assert r.xlen(k.output) == 0 and not r.exists(k.sealing)
    names = writer.spool.names(JOB)
    assert len(names) == 10 and names == sorted(names)
    records = [json.loads(r.hget(k.manifest, name)) for name in names]
    assert all(rec["location"] == SPOOLED and rec["spool"] == str(writer.spool.path(JOB, rec["name"]))
               for rec in records)
    c = _counters(r)
    assert c["batches"] == c["spooled"] == 10 and c.get("s3_uploaded", 0) == 0
    assert c["spooled_bytes"] == c["batch_bytes"] == sum(rec["bytes"] for rec in records)
    assert not (tmp_path / "s3" / JOB / "batches").exists()

    writer.storage.down = False
    _complete(book, range(500, 500))  # nothing new: the spool alone goes up
    writer.flush(JOB, final=True)
    assert writer.storage_failure is None and writer.spool.names(JOB) == []
    manifest, ids = _shipped(r, writer)
    assert [b["name"] for b in manifest["batches"]] == names
    assert ids == [f"p{i:04d}" for i in range(500)]  # in order, each once
    assert all(b["location"] == writer.storage.location(b["key"]) and "spool" not in b
               for b in manifest["batches"])
    c = _counters(r)
    assert c["batches"] == c["s3_uploaded"] == 10 and c["spooled"] == c["spooled_bytes"] == 0
    assert c["s3_bytes"] == c["batch_bytes"] == manifest["bytes"]


def test_batches_sealed_while_the_spool_drains_wait_behind_it(r, tmp_path):
    """Order: while spooled batches are not all up, a new batch goes to the spool too, even if S3
    would take it, so the storage always holds a prefix of the batches in sealing order."""
    book = _job(r, 150)
    writer = _writer(r, book, tmp_path)
    writer.storage.down = True
    _complete(book, range(100))
    writer.flush(JOB)
    first_two = writer.spool.names(JOB)
    # S3 takes one batch, then fails every other batch: the second spooled batch and the new
    # one wait.
    puts = []
    original = CutRemote.put

    def one_then_down(self, key, data):
        if "/batches/" in key:
            puts.append(key)
            if len(puts) > 1:
                raise StorageError(f"S3 upload {self.location(key)} failed: SlowDown")
        return original(self, key, data)

    writer.storage.down = False
    CutRemote.put = one_then_down
    try:
        _complete(book, range(100, 150))
        writer.flush(JOB)
    finally:
        CutRemote.put = original
    spooled = writer.spool.names(JOB)
    assert spooled[0] == first_two[1] and len(spooled) == 2
    manifest, _ = _shipped(r, writer)
    assert [b["name"] for b in manifest["batches"]] == first_two[:1]
    writer.storage.down = False
    writer.flush(JOB, final=True)
    manifest, ids = _shipped(r, writer)
    assert ids == [f"p{i:04d}" for i in range(150)]


def test_a_full_disk_keeps_the_rows_in_redis_and_raises(r, tmp_path, monkeypatch):
    """ENOSPC from the spool (os.write on a file under the spool fails, as on a full disk): the
    batch raises StorageError naming both failures, its rows and its intent stay in Redis, no
    half-written file is left; once the disk has room the same batch is spooled."""
    book = _job(r, 50)
    writer = _writer(r, book, tmp_path)
    writer.storage.down = True
    spool_root = str(writer.spool.root)
    real_write = os.write

    def full_disk(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(spool_root):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    _complete(book, range(50))
    with pytest.raises(StorageError) as err:
        writer.flush(JOB)
    assert "No space left on device" in str(err.value) and "S3 upload" in str(err.value)
    k = JobName(JOB)
    assert r.xlen(k.output) == 50 and r.exists(k.sealing) and not r.exists(k.manifest)
    assert list((writer.spool.root / JOB).iterdir()) == []  # the temporary file is gone

    monkeypatch.setattr(os, "write", real_write)  # room again
    assert writer.flush(JOB) and r.xlen(k.output) == 0 and len(writer.spool.names(JOB)) == 1


def test_a_spool_that_is_not_a_directory_fails_the_same_way(r, tmp_path):
    book = _job(r, 50)
    (tmp_path / "blocker").write_text("not a directory")
    writer = _writer(r, book, tmp_path, spool_root=tmp_path / "blocker" / "spool")
    writer.storage.down = True
    _complete(book, range(50))
    with pytest.raises(StorageError, match="spool could not take it"):
        writer.flush(JOB)
    assert r.xlen(JobName(JOB).output) == 50


STEPS = [  # (class or module, function, when): a beat dies right after this call
    (Spool, "write", lambda *a, **k: True),
    (sealing, "record_batch", lambda *a, **k: True),
    (sealing, "drop_sealed", lambda *a, **k: True),  # the batch's rows leave the stream
    # S3 is back: the spooled batch's upload, its record's switch, the manifest
    (CutRemote, "put", lambda _self, key, *a, **k: "/batches/" in key),
    (sealing, "ship_spooled", lambda *a, **k: True),
    (BatchWriter, "write_manifest", lambda *a, **k: True),
]


@pytest.mark.parametrize("step", range(len(STEPS)), ids=[f"after_{m}" for _, m, _ in STEPS])
def test_a_beat_killed_after_any_step_loses_and_doubles_nothing(r, tmp_path, monkeypatch, step):
    cls, method, when = STEPS[step]
    book = _job(r, 150)
    writer = _writer(r, book, tmp_path)
    writer.storage.down = True
    _complete(book, range(50))
    writer.flush(JOB)  # one batch spooled cleanly before
    _complete(book, range(50, 100))
    if step >= 3:
        writer.flush(JOB)
        writer.storage.down = False
    _crash_after(monkeypatch, cls, method, when)
    with pytest.raises(Crash):
        writer.flush(JOB)
    monkeypatch.undo()
    # The next beat, after the crash: S3 may still be down a while, then it answers.
    fresh = _writer(r, book, tmp_path, store=writer.storage)
    fresh.flush(JOB)
    fresh.storage.down = False
    _complete(book, range(100, 150))
    fresh.flush(JOB, final=True)
    manifest, ids = _shipped(r, fresh)
    assert ids == [f"p{i:04d}" for i in range(150)]
    assert [b["name"] for b in manifest["batches"]] == sorted(b["name"] for b in manifest["batches"])
    c = _counters(r)
    assert c["batches"] == c["s3_uploaded"] == 3 and c["spooled"] == c["spooled_bytes"] == 0
    assert fresh.spool.names(JOB) == [] and r.xlen(JobName(JOB).output) == 0
    assert not r.exists(JobName(JOB).sealing)


def test_dispatch_is_held_near_maxmemory_and_while_a_job_cannot_seal(r):
    from dflash_tasks.dispatch import hold

    _job(r, 10)

    def take(gpu: str = GPU) -> list[str]:
        return window.take(r, Settings(), JOB, gpu, 2, task="dflash_tasks.generate", origin="t",
                           reply_to="")

    used = r.info("memory")["used_memory"]
    r.config_set("maxmemory", used * 2)
    try:
        assert hold.check_memory(r, 0.9, 10) is None and not r.exists(MEMORY_HOLD)
        held = hold.check_memory(r, 0.4, 10)  # used / maxmemory is about 0.5: held
        assert held["maxmemory"] == used * 2 and r.exists(MEMORY_HOLD)
        assert take() == []
        assert hold.check_memory(r, 0.9, 10) is None and not r.exists(MEMORY_HOLD)
        # Issue 28: nothing to seal, so a hold would free nothing and never clear (what fills
        # Redis leaves only as it is dispatched): dispatch goes on.
        assert hold.check_memory(r, 0.4, 0) is None and not r.exists(MEMORY_HOLD)
        assert len(take("gpu1@a")) == 2
    finally:
        r.config_set("maxmemory", 0)
    assert hold.check_memory(r, 0.01, 10) is None  # no maxmemory: nothing to measure against

    hold.hold_job(r, JOB, "storage", "S3 down and the spool's disk full")
    assert take() == []
    from dflash_tasks.output.progress import snapshot

    snap = snapshot(r, JOB, Settings())
    assert snap["dispatch_held"]["reason"] == "storage" and "disk full" in snap["dispatch_held"]["error"]
    hold.release_job(r, JOB)
    assert len(take()) == 2 and snapshot(r, JOB, Settings())["dispatch_held"] is None


def test_a_shipped_spool_file_stays_until_a_replica_has_its_record(tmp_path):
    """Issue 27, item 5: with DFLASH_REDIS_WAIT_REPLICAS, a spooled batch's file leaves beat's
    disk only once a replica has the manifest record that says it is in the storage; a failover
    could otherwise lose the only record of where it went. A replica that does not answer (here
    stopped with SIGSTOP) keeps the file for the next flush."""
    import signal

    from support import Proc, free_port

    def server(name: str, *extra: str) -> tuple[Proc, redis_lib.Redis]:
        port = free_port()
        (tmp_path / name).mkdir()
        proc = Proc(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "yes", "--dir", str(tmp_path / name), *extra],
                    tmp_path / f"{name}.log")
        client = redis_lib.Redis(port=port)
        wait_until(client.ping, timeout=20, what=f"redis {name}")
        return proc, client

    master_proc, master = server("master")
    replica_proc, replica = server("replica", "--replicaof", "127.0.0.1",
                                   str(master.connection_pool.connection_kwargs["port"]))
    try:
        wait_until(lambda: replica.info("replication")["master_link_status"] == "up", timeout=30,
                   what="the replica in sync")
        jobs.save(master, JOB, jobs.GenerationParams(), selection=jobs.GpuSelection.parse("all"),
                  dataset="x", status="running")
        book = Ledger(master, wait_replicas=1, wait_timeout_ms=300)
        book.add_prompts(JOB, [(f"p{i:04d}", "[]") for i in range(50)])
        writer = _writer(master, book, tmp_path)
        writer.storage.down = True
        _complete(book, range(50))
        assert writer.flush(JOB) and writer.spool.names(JOB)
        writer.storage.down = False
        replica_proc._signal(signal.SIGSTOP)  # the replica acknowledges nothing
        try:
            writer.flush(JOB)
            [record] = [json.loads(v) for v in master.hvals(JobName(JOB).manifest)]
            assert record["location"] != SPOOLED                 # shipped, recorded on the master
            assert writer.spool.names(JOB), "the file stays until a replica has the record"
        finally:
            replica_proc._signal(signal.SIGCONT)
        writer.flush(JOB)
        assert writer.spool.names(JOB) == []
        [record] = [json.loads(v) for v in replica.hvals(JobName(JOB).manifest)]
        assert record["location"] != SPOOLED
    finally:
        replica_proc.stop()
        master_proc.stop()


def test_beat_without_s3_says_why_a_spooled_job_waits_and_delete_takes_the_spool(cluster, r, tmp_path):
    """Issue 27, item 11: batches spooled for S3, then beat restarted without DFLASH_S3_URI.
    Before: the job stayed running forever with nothing said, and delete left the files. Now
    status names the cause, and delete removes the job's spool."""
    c = cluster(spool_dir=str(tmp_path / "spool"))
    book = _job(r, 50)
    writer = _writer(r, book, tmp_path, spool_root=tmp_path / "spool")
    writer.storage.down = True
    _complete(book, range(50))
    assert writer.flush(JOB, final=True) and writer.spool.names(JOB)
    c.start_beat()
    snap = wait_until(lambda: (s := c.status(JOB))["storage_error"] and s, timeout=60,
                      what="the spool's reason in status")
    assert "without DFLASH_S3_URI" in snap["storage_error"]["error"] and snap["status"] == "running"
    c.manage("pause", "--job", JOB)
    out = c.manage("delete", "--job", JOB, "--yes").stdout
    assert "1 batches removed from the spool" in out, out
    assert not (tmp_path / "spool" / JOB).exists()


# -- a whole run against moto's S3 server ------------------------------------------------------------

def test_a_long_outage_keeps_redis_flat_then_every_row_ships_once(cluster, moto, tmp_path):
    """S3 cut from the start and the spool's disk unwritable: dispatch is held with the reason in
    status, and Redis holds only what was in flight. The disk comes back: dispatch resumes, and
    batch after batch goes to the spool while the output stream stays as short as one batch.
    S3 comes back: every spooled batch goes up in order, once, and the job is done."""
    proxy = TcpProxy(moto.port)  # not started: S3 refuses connections
    blocker = tmp_path / "full-disk"
    blocker.write_text("the spool's directory cannot be made under a file")
    rows = 20
    c = s3_cluster(cluster, proxy.url, batch_rows=rows, batch_max_age_s=1,
                   spool_dir=str(blocker / "spool"))
    c.start_servers(2, SIM_ARGS)
    c.start_workers()
    c.start_beat()
    path, ids = dataset(tmp_path, 1400)
    c.manage("enqueue", "--dataset", str(path), "--job", "flat", "--gpus", "2")
    k = JobName("flat")

    held = wait_until(lambda: (s := c.status("flat"))["dispatch_held"] and s, timeout=120,
                      interval=0.5, what="dispatch held")
    assert held["dispatch_held"]["reason"] == "storage"
    assert "spool could not take it" in held["dispatch_held"]["error"]
    assert "s3://" in held["storage_error"]["error"]
    # What was in flight finishes; nothing new starts.
    stopped = wait_until(lambda: (s := c.status("flat"))["in_flight"] == 0 and s, timeout=120,
                         interval=0.5, what="the requests in flight to finish")
    assert stopped["pending"] > 0 and stopped["spooled_batches"] == 0
    assert c.status("flat")["completed"] == stopped["completed"] == c.r.xlen(k.output)
    text = " ".join(c.manage("status", "--job", "flat").stdout.split())
    assert "dispatch held no sealed batch can leave Redis" in text and "resumes by itself" in text, text

    blocker.unlink()  # room on the disk again
    spooled = lambda: int(c.r.hget(k.counters, "spooled") or 0)  # noqa: E731
    wait_until(lambda: spooled() >= 10, timeout=120, what="what waited in Redis to be spooled")
    assert c.status("flat")["dispatch_held"] is None
    # The outage goes on for 40 more batches: the stream holds about the rows of a tick or two,
    # however many batches the outage has sealed (without the spool it would hold every one).
    lengths, memory, seals = [], [], []
    first = spooled()

    def sample():
        lengths.append(c.r.xlen(k.output))
        memory.append(c.r.memory_usage(k.output, samples=0) or 0)
        now = (spooled(), int(c.r.hget(k.counters, "completed") or 0))
        if not seals or now[0] > seals[-1][0]:
            seals.append(now)  # (batches spooled, rows completed) each time a batch left
        return now[0] >= first + 40
    wait_until(sample, timeout=300, interval=0.1, what="forty more batches in the spool")
    last = spooled()
    during = c.status("flat")
    assert during["dispatch_held"] is None and "s3://" in during["storage_error"]["error"]
    assert during["s3_uploaded"] == 0 and during["spooled_batches"] >= last
    # The bound, stated against what this run did (a slow machine seals later, and more rows
    # wait meanwhile): the stream holds what finished between two batches leaving Redis, and a
    # batch more, or, while rows finish in a burst faster than beat seals them (the end game's
    # rounds end many generations together), a few ticks' worth: never more than a quarter of
    # what went through it. Rows the outage kept in Redis would pile up over forty batches, all
    # of it.
    between = max(b[1] - a[1] for a, b in zip(seals, seals[1:]))
    passed_rows = seals[-1][1] - seals[0][1]
    bound = max(between + rows, passed_rows // 4)
    assert max(lengths) <= bound, (max(lengths), between, passed_rows, lengths)
    spool_dir = blocker / "spool" / "flat"
    assert len(list(spool_dir.glob("batch-*.jsonl.zst"))) >= last

    proxy.start()
    try:
        c.wait_done("flat", timeout=400)
        st = storage(moto.url)
        manifest, _ = assert_shipped_exactly_once(c, st, "flat", ids)
        names = [b["name"] for b in manifest["batches"]]
        window = manifest["batches"][first:last]  # every batch was spooled, in name order
        sizes = [len(zstandard.ZstdDecompressor().decompress(st.get(b["key"]))) for b in window]
    finally:
        proxy.stop()
    # The same in bytes, each row priced at the batch of the largest rows (in rounds the long
    # generations end together, late).
    per_row = max(sizes) / rows
    assert max(memory) <= 1.5 * bound * per_row, (max(memory), bound, per_row)
    assert names == sorted(names) and list(spool_dir.glob("*")) == []
    assert all(b["location"].startswith("s3://") and "spool" not in b for b in manifest["batches"])
    final = c.status("flat")
    assert final["spooled_batches"] == 0 and final["storage_error"] is None
    log = c.beat.log()
    order = re.findall(r"shipped (batch-\d+-\d+) from the spool", log)
    assert len(order) >= 50 and order == sorted(order) and not [n for n, m in Counter(order).items() if m > 1]
    assert "dispatch resumes" in log and "Traceback" not in log
