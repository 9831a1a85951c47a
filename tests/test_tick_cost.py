"""Beat's tick costs the same whatever the size of the run: at 1,000 or 100,000 rows waiting in
the stream, and at 10 or 1,000 batches shipped, it sends the same Redis commands and reads the
same bytes (counters and ids, never a row). Rows are read once, by the tick that seals them.
The states are built directly in Redis, as complete.lua and record_batch.lua leave them."""
from __future__ import annotations

import json

import pytest
import redis as redis_lib

from dflash_tasks.core import jobs
from dflash_tasks.core.keys import JobName
from dflash_tasks.output.batches import MANIFEST_PART_BATCHES

GPUS = ("gpu0@a", "gpu1@a")
# A small row (100,000 of them stay quick to build), in the shipped shape.
ROW = json.dumps({"id": "x", "status": "success", "conversations": [
    {"role": "user", "content": "q"}, {"role": "assistant", "content": "a" * 300}], "metadata": {
    "finish_reason": "stop", "prompt_tokens": 10, "completion_tokens": 100, "gpu": GPUS[0],
    "latency_s": 1.0, "completed_at": 1_700_000_000}})
ROW_READS = {"XRANGE", "XREVRANGE", "XREAD", "XREADGROUP", "XINFO"}


@pytest.fixture
def r(redis_url):
    return redis_lib.Redis.from_url(redis_url)


@pytest.fixture
def beat_env(redis_url, tmp_path, monkeypatch):
    """tick_job as beat runs it, on the test database, with fresh process-wide settings, client and
    ledger (and the previous ones back afterwards)."""
    from dflash_tasks.core.connections import redis_client
    from dflash_tasks.core.settings import get_settings
    from dflash_tasks.ledger import shared_ledger

    def configure(**settings):
        monkeypatch.setenv("DFLASH_REDIS_URL", redis_url)
        monkeypatch.setenv("DFLASH_OUTPUT_DIR", str(tmp_path / "output"))
        for key, value in settings.items():
            monkeypatch.setenv(f"DFLASH_{key.upper()}", str(value))
        for cached in (get_settings, redis_client, shared_ledger):
            cached.cache_clear()

    yield configure
    monkeypatch.undo()
    for cached in (get_settings, redis_client, shared_ledger):
        cached.cache_clear()


def build(r, name: str, waiting: int, shipped: int) -> None:
    """A running job with `waiting` rows in its stream and `shipped` batches in its manifest, and
    prompts still pending (so no tick is the final one)."""
    name = k = JobName(name)
    jobs.save(r, name, jobs.GenerationParams(), selection=jobs.GpuSelection.parse("2"),
              dataset="x", status="running")
    r.sadd(k.gpus, *GPUS)
    r.rpush(k.pending, *(f"p{i}" for i in range(100)))
    first = None
    for start in range(0, waiting, 10_000):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(waiting, start + 10_000)):
            pipe.xadd(k.output, {"id": f"d{i}", "row": ROW})
        ids = pipe.execute()
        first = first or ids[0]
    # What complete.lua keeps beside the rows: the bytes waiting and the oldest row's time.
    r.hset(k.counters, mapping={
        "total": waiting + 100 + shipped * 1000, "completed": waiting + shipped * 1000,
        "batches": shipped, "unsealed_bytes": waiting * (len(ROW) + 1),
        "unsealed_since_ms": first.decode().split("-")[0]})
    for b in range(shipped):
        record = {"name": f"batch-{1_700_000_000_000 + b:013d}-0000", "rows": 1000,
                  "bytes": 123_456, "sha256": "0" * 64, "first_completed_at": 1.0,
                  "last_completed_at": 2.0, "sealed_at": 3.0}
        record["key"] = f"{name}/batches/{record['name']}.jsonl.zst"
        r.hset(k.manifest, record["name"], json.dumps(record))
    # Their manifest's full parts were written as they filled (batches.write_manifest).
    r.set(k.manifest_parts, shipped // MANIFEST_PART_BATCHES)


def _size(value) -> int:
    if isinstance(value, (bytes, str)):
        return len(value)
    if isinstance(value, dict):
        return sum(_size(k) + _size(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_size(v) for v in value)
    return 8  # a number, None, a bool


def measure(monkeypatch, work) -> dict[str, int]:
    """Redis command name -> bytes of their replies, over everything `work` sends (each command
    counted by name: `"XLEN#2"` is the second XLEN)."""
    sent: dict[str, int] = {}
    real_execute = redis_lib.client.Pipeline.execute
    real_command = redis_lib.Redis.execute_command

    def note(name: str, reply) -> None:
        n = sum(1 for key in sent if key.split("#")[0] == name)
        sent[f"{name}#{n + 1}"] = _size(reply)

    def execute(self, *a, **kw):
        names = [str(args[0]).upper() for args, _ in self.command_stack]
        replies = real_execute(self, *a, **kw)
        for name, reply in zip(names, replies):
            note(name, reply)
        return replies

    def command(self, *args, **kw):
        reply = real_command(self, *args, **kw)
        note(str(args[0]).upper(), reply)
        return reply

    with monkeypatch.context() as m:
        m.setattr(redis_lib.client.Pipeline, "execute", execute)
        m.setattr(redis_lib.Redis, "execute_command", command)
        work()
    return sent


def tick(name: str) -> None:
    from dflash_tasks.tasks.control import tick_job

    tick_job(JobName(name))


def tick_cost(r, monkeypatch, name: str, waiting: int, shipped: int) -> dict[str, int]:
    build(r, name, waiting, shipped)
    tick(name)  # the first tick writes what later ticks only overwrite (progress.json...)
    return measure(monkeypatch, lambda: tick(name))


def test_a_tick_costs_the_same_at_any_backlog_and_any_number_of_batches(r, beat_env, monkeypatch):
    # Batches so large and so patient that no tick here seals: this is the tick of every 5 s.
    beat_env(batch_rows=10**6, batch_bytes=10**12, batch_max_age_s=3600)
    small = tick_cost(r, monkeypatch, "small", waiting=1_000, shipped=10)
    large = tick_cost(r, monkeypatch, "large", waiting=100_000, shipped=1_000)

    assert list(small) == list(large)  # the same commands, in the same order
    assert not ROW_READS & {key.split("#")[0] for key in small}, small
    # The same bytes but for the digits of larger counts (completed, total, ...): not one row.
    assert abs(sum(small.values()) - sum(large.values())) < len(ROW) // 4, (small, large)
    assert r.xlen(JobName("large").output) == 100_000  # and it sealed nothing


def test_a_tick_makes_one_snapshot_of_its_job(r, beat_env, monkeypatch):
    """The snapshot (every figure of progress.json) is made once per tick: sealing before it
    reads a few counts, and the snapshot it writes is the one that decides `done`."""
    from dflash_tasks.tasks import control

    beat_env(batch_rows=1000)
    build(r, "once", waiting=2_500, shipped=3)
    made = []
    real = control.snapshot
    monkeypatch.setattr(control, "snapshot", lambda *a, **kw: made.append(a[1]) or real(*a, **kw))
    tick("once")
    assert made == ["once"]
    assert r.hlen(JobName("once").manifest) == 5  # and it sealed: a tick with work to do


def test_a_tick_that_seals_reads_each_row_once(r, beat_env, monkeypatch):
    """The tick that seals a batch reads its rows once (no look before, no quality read
    after): the stream's bytes read are the batch's, whatever else waits or was shipped."""
    beat_env(batch_rows=1_000, batch_bytes=10**12, batch_max_age_s=3600)
    build(r, "warm", 1_000, 0)
    tick("warm")  # Redis learns the ledger's scripts
    costs = {}
    for name, shipped in (("few", 10), ("many", 1_000)):
        build(r, name, 1_000, shipped)
        costs[name] = measure(monkeypatch, lambda: tick(name))
        assert r.xlen(JobName(name).output) == 0 and r.hlen(JobName(name).manifest) == shipped + 1
    for cost in costs.values():
        stream_bytes = sum(v for key, v in cost.items() if key.split("#")[0] in ROW_READS)
        assert 1_000 * len(ROW) <= stream_bytes < 1_000 * (len(ROW) + 64), cost
    # The same commands at 10 and 1,000 batches shipped. The one reply that grows is the
    # manifest's (HVALS: the records manifest.json and its parts are made from), not the tick's.
    assert list(costs["few"]) == list(costs["many"])
    # (The stream's replies, checked above, carry ids whose sequence numbers vary in digits.)
    rest = {name: sum(v for key, v in cost.items() if key.split("#")[0] not in {"HVALS", *ROW_READS})
            for name, cost in costs.items()}
    assert abs(rest["few"] - rest["many"]) < len(ROW) // 4, costs


def test_the_counters_a_tick_reads_follow_the_stream_exactly(r, tmp_path):
    """unsealed_bytes and unsealed_since_ms (complete.lua adds, drop_sealed.lua takes back)
    always say what the stream holds, so the size and age thresholds hold without reading rows."""
    from dflash_tasks.ledger import Ledger
    from dflash_tasks.output.batches import BatchPolicy, BatchWriter
    from dflash_tasks.output.storage import LocalStorage

    name = k = JobName("exact")
    book = Ledger(r)
    jobs.save(r, name, jobs.GenerationParams(), selection=jobs.GpuSelection.parse("1"),
              dataset="x", status="running")
    book.add_prompts(name, [(f"p{i}", "[]") for i in range(25)])

    def complete(i: int) -> None:
        book.complete(name, f"p{i}", GPUS[0], {"id": f"p{i}", "status": "success", "conversations": [],
                      "metadata": {"finish_reason": "stop", "prompt_tokens": 3, "gpu": GPUS[0],
                                   "completion_tokens": i, "completed_at": i, "pad": "x" * i}})

    def stream_state() -> tuple[int | None, int | None]:
        entries = r.xrange(k.output)
        if not entries:
            return None, None
        return (sum(len(fields[b"row"]) + 1 for _, fields in entries),
                int(entries[0][0].decode().split("-")[0]))

    def counters() -> tuple[int | None, int | None]:
        size, since = r.hmget(k.counters, "unsealed_bytes", "unsealed_since_ms")
        return (int(size) if size else None), (int(since) if since else None)

    for i in range(25):
        complete(i)
    assert counters() == stream_state() and counters()[0] > 0
    # A batch cut by size: the threshold counts the same bytes the batch does.
    size_of_ten = sum(len(fields[b"row"]) + 1 for _, fields in r.xrange(k.output, count=10))
    writer = BatchWriter(r, book, LocalStorage(tmp_path), BatchPolicy(rows=100, bytes=size_of_ten,
                                                                      max_age_s=3600))
    assert len(writer.flush(name)) == 2  # two batches of ten rows; the five left are not enough
    assert r.xlen(k.output) == 5 and counters() == stream_state()
    assert counters()[0] < size_of_ten
    # Young rows wait; old ones (by their stream id's time) are sealed.
    assert writer.flush(name) == []
    r.hset(k.counters, "unsealed_since_ms", counters()[1] - 3_600_000)
    assert len(writer.flush(name)) == 1 and r.xlen(k.output) == 0
    assert counters() == stream_state() == (None, None)
    complete(0)  # a duplicate delivery adds nothing
    assert counters() == (None, None)


def _fill_unacked(r, n: int, job: str) -> None:
    """`n` delivered, unacknowledged messages in kombu's `unacked` hash, as 64 GPUs with about 300
    requests each hold them: task messages of this job and of others, a share of them retries
    waiting for their ETA."""
    from failure_support import kombu_entry

    pipe = r.pipeline(transaction=False)
    for i in range(n):
        gpu = f"gpu{i % 8}@n{i % 64 // 8}"
        body = json.dumps([[job if i % 3 else "other", f"p{i}", gpu], {"tries": i % 4},
                           {"callbacks": None, "errbacks": None, "chain": None, "chord": None}])
        entry = json.loads(kombu_entry(body.encode(), "application/json", gpu,
                                       args=[job, f"p{i}", gpu]))
        if i % 5 == 0:
            entry["headers"]["eta"] = "2099-01-01T00:00:00+00:00"
        pipe.hset("unacked", f"tag-{i}", json.dumps([entry, "", gpu]))
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()


def test_status_and_a_tick_cost_the_same_whatever_the_broker_holds(r, beat_env, monkeypatch):
    """Issue 28: the retries waiting were counted by reading every message of kombu's `unacked`
    hash (2.5 ms empty, 517 ms at 20,000 entries). They are counted inside Redis from the GPUs'
    `retrying` sets now: the snapshot and the tick send the same commands, read the same bytes,
    and never touch `unacked`, with none or 20,000 messages there."""
    from dflash_tasks.core.settings import get_settings
    from dflash_tasks.output.progress import snapshot

    beat_env(batch_rows=10**6, batch_bytes=10**12, batch_max_age_s=3600)
    build(r, "fleet", 1_000, 10)
    k = JobName("fleet")
    r.zadd(k.inflight(GPUS[0]), {f"p{i}": 1 for i in range(50)})
    r.zadd(k.retrying(GPUS[0]), {f"p{i}": 2**40 for i in range(0, 50, 5)})  # 10 waiting there
    r.zadd(k.retrying(GPUS[0]), {"recalled": 2**40})  # no longer in flight: not counted
    tick("fleet")
    costs = {}
    for held in (0, 20_000):
        _fill_unacked(r, held, "fleet")
        costs[held] = measure(monkeypatch, lambda: (snapshot(r, JobName("fleet"), get_settings()),
                                                    tick("fleet")))
        snap = snapshot(r, JobName("fleet"), get_settings())
        assert snap["retry_waiting"] == 10 and snap["gpus"][GPUS[0]]["in_flight"] == 40
    assert list(costs[0]) == list(costs[20_000])  # the same commands, in the same order
    assert "HSCAN" not in {key.split("#")[0] for key in costs[0]}
    assert abs(sum(costs[0].values()) - sum(costs[20_000].values())) < 64, costs
    assert r.hlen("unacked") == 20_000


def test_manifest_writes_grow_with_the_run_not_its_square(r, tmp_path):
    """Issue 28: manifest.json was rewritten whole after every sealed batch, so the bytes put
    grew with the square of the batches (about 40 GB over ten million prompts). In parts, what is
    written over 400 batches stays within 8 times the final manifest (its parts and
    manifest.json together); every reader still sees every batch, in order."""
    from dflash_tasks.ledger import Ledger
    from dflash_tasks.output.batches import BatchPolicy, BatchWriter, read_manifest
    from dflash_tasks.output.storage import LocalStorage

    class Counted(LocalStorage):
        written = 0

        def put(self, key: str, data: bytes) -> None:
            if "/manifest" in key:
                Counted.written += len(data)
            super().put(key, data)

    name, n = JobName("parts"), 400
    book = Ledger(r)
    jobs.save(r, name, jobs.GenerationParams(), selection=jobs.GpuSelection.parse("1"),
              dataset="x", status="running")
    book.add_prompts(name, [(f"p{i}", "[]") for i in range(n)])
    writer = BatchWriter(r, book, Counted(tmp_path), BatchPolicy(rows=1, bytes=10**9, max_age_s=3600))
    for i in range(n):
        book.complete(name, f"p{i}", GPUS[0], {"id": f"p{i}", "status": "success", "conversations": [],
                      "metadata": {"finish_reason": "stop", "prompt_tokens": 3, "gpu": GPUS[0],
                                   "completion_tokens": 5, "completed_at": i}})
        assert len(writer.flush(name)) == 1
    final = sum(p.stat().st_size for p in (tmp_path / name).glob("manifest*")) + \
        sum(p.stat().st_size for p in (tmp_path / name / "manifest").glob("*.json"))
    assert Counted.written <= 8 * final, (Counted.written, final)
    manifest = read_manifest(LocalStorage(tmp_path), name)
    assert [rec["rows"] for rec in manifest["batches"]] == [1] * n and manifest["rows"] == n
    names = [rec["name"] for rec in manifest["batches"]]
    assert names == sorted(names) and len(set(names)) == n
    assert len(list((tmp_path / name / "manifest").glob("part-*.json"))) == n // 8
