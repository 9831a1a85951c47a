"""Prompt bodies kept on the output storage (`enqueue --bodies storage`, ledger/bodies.py): Redis
holds a reference of about 20 bytes per prompt, the worker reads the body back with a ranged read,
a storage outage is waited out without spending attempts, and `delete` takes the chunks away.
Real Redis, real workers and beat, the simulated servers, and moto's S3 server over HTTP."""
from __future__ import annotations

import gzip
import json
import subprocess

import pytest
import redis
from failure_support import check_books, sim_hold, sim_release, sim_stats
from s3support import BUCKET, TcpProxy, assert_shipped_exactly_once, s3_cluster, storage
from support import hints_in, paste, wait_until
from test_pipeline import SIM_ARGS, assert_exactly_once, dataset, start

from dflash_tasks.core import jobs
from dflash_tasks.core.keys import JobName
from dflash_tasks.core.settings import Settings
from dflash_tasks.ingest.loader import PromptLoader
from dflash_tasks.ingest.prompts import Prompt
from dflash_tasks.ledger import Ledger, bodies
from dflash_tasks.ledger.messages import compress_messages_json, decode_messages
from dflash_tasks.output.storage import LocalStorage, StorageCorrupt, StorageError, StorageNotFound


def prompts(n: int, start: int = 0) -> list[Prompt]:
    return [Prompt(id=f"p{i}", messages=({"role": "user", "content": f"question {i} ✓ " * (i % 7 + 1)},),
                   line=i) for i in range(start, start + n)]


def chunk_files(root, job: str) -> list[str]:
    return sorted(p.name for p in (root / job / bodies.BODIES_DIR).glob("*.zst"))


def test_references_in_redis_bodies_in_chunks_and_a_resume_writes_only_new_ones(redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    book, k = Ledger(r), JobName("refs")
    jobs.save(r, JobName("refs"), jobs.GenerationParams(), selection=jobs.GpuSelection(), dataset="d")
    location = bodies.job_location(r, JobName("refs"), Settings(output_dir=tmp_path / "out"))
    assert location == str((tmp_path / "out").resolve())
    writer = bodies.ChunkWriter(r, JobName("refs"), location, LocalStorage(location))
    first = prompts(2500)
    assert PromptLoader(r, book, JobName("refs"), resume=False, store_bodies=writer).add_all(iter(first), chunk=1000) == 2500
    assert chunk_files(tmp_path / "out", "refs") == [f"chunk-00000{n}.zst" for n in (1, 2, 3)]
    for p in (first[0], first[999], first[1000], first[2499]):
        stored = r.hget(k.prompts, p.id)
        assert bodies.is_reference(stored) and len(stored) <= 24, stored
        frame = bodies.read_frame(LocalStorage(tmp_path / "out"), "refs", stored)
        assert decode_messages(frame) == list(p.messages)

    # What a worker reads: no messages in Redis, the job's location beside the reference.
    state = book.task_state(JobName("refs"), "p7", "gpu0@n")
    assert state.messages is None and state.stored
    assert state.body_reference == r.hget(k.prompts, "p7")
    assert state.body_location == location

    # A resume with 2,000 done and 300 new prompts writes one more chunk, of the new ones only,
    # and a later enqueue from elsewhere keeps the job's first location.
    done = [p.id for p in first[:2000]]
    r.sadd(k.done, *done)
    r.hdel(k.prompts, *done)
    r.ltrim(k.pending, 2000, -1)
    assert bodies.job_location(r, JobName("refs"), Settings(output_dir=tmp_path / "other")) == location
    elsewhere = bodies.ChunkWriter(r, JobName("refs"), location, LocalStorage(location))
    again = PromptLoader(r, book, JobName("refs"), resume=True, store_bodies=elsewhere)
    assert again.add_all(iter(first + prompts(300, start=2500)), chunk=1000) == 300
    assert chunk_files(tmp_path / "out", "refs")[-1] == "chunk-000004.zst"
    new_refs = [bodies.Reference.parse(r.hget(k.prompts, f"p{i}")) for i in range(2500, 2800)]
    assert {ref.chunk for ref in new_refs} == {4}
    assert len(LocalStorage(tmp_path / "out").get("refs/prompts/chunk-000004.zst")) == \
        sum(ref.length for ref in new_refs)
    assert r.llen(k.pending) == 800


def test_storage_ranged_reads_and_prefix_removal_locally_and_on_s3(tmp_path, moto):
    local = LocalStorage(tmp_path)
    remote = storage(moto.url)
    for st in (local, remote):
        st.put("job/prompts/chunk-000001.zst", b"0123456789")
        st.put("job/prompts/chunk-000002.zst", b"abc")
        st.put("job/batches/keep.jsonl.zst", b"rows")
        assert st.get_range("job/prompts/chunk-000001.zst", 3, 4) == b"3456"
        with pytest.raises(StorageError, match="expected 5"):
            st.get_range("job/prompts/chunk-000002.zst", 1, 5)  # past the end: never half a body
        with pytest.raises(StorageNotFound):
            st.get_range("job/prompts/chunk-000009.zst", 0, 1)
        assert st.delete_prefix("job/prompts/") == 2
        assert not st.exists("job/prompts/chunk-000001.zst")
        assert st.get("job/batches/keep.jsonl.zst") == b"rows"
        assert st.delete_prefix("job/prompts/") == 0
    with pytest.raises(StorageError, match="outside"):
        local.delete_prefix("../elsewhere/")


def garble(chunk, ref: bodies.Reference, how: str) -> None:
    """Overwrite one frame of a chunk in place, its length kept: with zeros (not a zstd frame,
    and not JSON), or behind zstd's magic number (a frame that does not decompress)."""
    with open(chunk, "r+b") as f:
        if how == "zeros":
            f.seek(ref.offset)
            f.write(bytes(ref.length))
        else:
            f.seek(ref.offset + 4)
            f.write(b"\xff" * (ref.length - 4))


def test_a_body_read_tells_bytes_that_are_not_a_prompt_from_a_storage_that_gives_none(tmp_path):
    """Issue 38, item 7: what bodies.read_body raises decides between holding the GPU (the
    storage's errors) and failing the prompt (BodyCorrupt, BodyLost)."""
    st = LocalStorage(tmp_path)
    turns = [{"role": "user", "content": "question ✓"}]
    entries = [turns, {"messages": turns, "continue": {"response_ids": [1, 2]}}, turns, turns,
               {"not": "a conversation"}]
    frames = [compress_messages_json(json.dumps(e).encode()) for e in entries]
    refs = bodies.write_chunk(st, "j", 1, frames)
    chunk = tmp_path / "j" / bodies.BODIES_DIR / "chunk-000001.zst"
    garble(chunk, bodies.Reference.parse(refs[2]), "zeros")
    garble(chunk, bodies.Reference.parse(refs[3]), "behind the magic")
    assert bodies.read_body(st, "j", refs[0]) == turns
    assert bodies.read_body(st, "j", refs[1]) == entries[1]  # regenerate --continue's entry
    for ref, why in ((refs[2], "JSONDecodeError|UnicodeDecodeError"), (refs[3], "ZstdError"),
                     (refs[4], "JSON of the wrong shape")):
        with pytest.raises(bodies.BodyCorrupt, match=f"chunk-000001.zst: bytes .* are not a "
                                                     f"prompt's text \\(({why})"):
            bodies.read_body(st, "j", ref)
    with pytest.raises(bodies.BodyLost):
        bodies.read_body(st, "j", b"@1:x")
    with pytest.raises(StorageCorrupt, match="shorter than its references"):
        bodies.read_body(st, "j", b"@1:0:100000")
    with pytest.raises(StorageNotFound):
        bodies.read_body(st, "j", bodies.Reference(2, 0, 10).encode())


def test_a_run_with_bodies_on_local_storage_regenerated_then_deleted(cluster, tmp_path):
    c = cluster()
    start(c)
    path, ids = dataset(tmp_path, 1500)
    k = JobName("local")
    c.manage("enqueue", "--dataset", str(path), "--job", "local", "--gpus", "2", "--bodies", "storage",
             "--max-output-tokens", "2048")
    # Redis holds references only, but for the generations between two of the end game's
    # rounds (this small job runs in rounds): their exact ids to go on from. The bodies are two
    # chunks under the output directory.
    stored = c.r.hvals(k.prompts)
    assert stored and all(bodies.is_reference(s) or "continue" in decode_messages(s)
                          for s in stored)
    assert sum(not bodies.is_reference(s) for s in stored) <= int(c.r.hget(k.counters, "rounds") or 0)
    assert chunk_files(c.output_dir, "local") == ["chunk-000001.zst", "chunk-000002.zst"]
    c.wait_done("local")
    rows = assert_exactly_once(c, "local", ids)
    asked = {json.loads(line)["id"]: json.loads(line)["prompt"] for line in path.read_text().splitlines()}
    assert all(row["conversations"][0] == {"role": "user", "content": asked[row["id"]]} for row in rows)
    assert {row["metadata"]["attempts"] for row in rows} == {1}

    # The index of truncated rows keeps each prompt's reference, not its text; a plain
    # regenerate puts the reference back, and the worker reads the chunk again.
    cut = {pid.decode() for pid in c.r.hkeys(k.ended("length"))}
    assert len(cut) > 50
    assert all(raw.partition(b"\n")[2][:1] == bodies.MARK for raw in c.r.hvals(k.ended("length")))
    c.manage("set", "--job", "local", "--max-output-tokens", "8192")
    out = c.manage("regenerate", "--job", "local", "--finish-reason", "length").stdout
    assert f"{len(cut):,} prompts with finish_reason 'length' queued" in out
    c.wait_done("local")
    newest = {row["id"]: row for row in c.rows("local")}  # batches in time order
    assert set(newest) == ids
    for pid in cut:
        assert newest[pid]["conversations"][0] == {"role": "user", "content": asked[pid]}
        assert newest[pid]["metadata"]["completion_tokens"] > 2048 or \
            newest[pid]["metadata"]["finish_reason"] == "stop", pid

    out = c.manage("delete", "--job", "local", "--yes")
    assert "2 chunks of prompt bodies removed" in out.stdout
    assert chunk_files(c.output_dir, "local") == []
    assert list((c.output_dir / "local" / "batches").iterdir()), "shipped batches stay"


def test_s3_out_while_bodies_are_read_spends_no_attempt_and_loses_nothing(cluster, moto, tmp_path):
    proxy = TcpProxy(moto.port).start()
    # The tests' cluster retries after at most 2 s instead of the deployed 120 s, so the outage
    # test ends soon after S3 is back; the retry path taken is the same.
    c = s3_cluster(cluster, proxy.url, batch_rows=100)
    path, ids = dataset(tmp_path, 600)
    c.manage("enqueue", "--dataset", str(path), "--job", "cut", "--gpus", "1", "--bodies", "storage")
    st = storage(moto.url)
    assert st.list("cut/prompts/") == ["cut/prompts/chunk-000001.zst"]
    proxy.stop()
    try:
        start(c, gpus=(0,))
        # Every prompt dispatched waits on the storage: retried, counted, nothing generated.
        wait_until(lambda: int(c.r.hget("dflash:{cut}:counters", "retry:prompt_storage") or 0) >= 100,
                   timeout=120, what="the worker to wait out the storage")
        assert int(c.r.hget("dflash:{cut}:counters", "completed") or 0) == 0
        assert int(c.r.hget("dflash:{cut}:counters", "failed") or 0) == 0
    finally:
        proxy.start()
    c.wait_done("cut", timeout=240)
    _, rows = assert_shipped_exactly_once(c, st, "cut", ids)
    assert {row["metadata"]["attempts"] for row in rows} == {1}, "a storage retry spends no attempt"
    worker_log = c.workers[0].log()
    assert "Traceback" not in worker_log
    # Hundreds of failed reads, one warning for the outage and one for its end.
    assert worker_log.count("cannot read its text") == 1, worker_log[-3000:]
    assert worker_log.count("prompt texts readable again") == 1

    # delete with S3 cut: the job leaves Redis all the same, and the command fails saying where
    # its chunk is left and what removes it (issue 38). A new job of the same name, enqueued
    # before that runs, keeps its own chunk: numbered after the deleted job's.
    # Its chunks: the enqueue's, and those the end game's rounds stored and removed again.
    last = jobs.last_body_chunk(c.r, JobName("cut"))
    proxy.stop()
    try:
        left = c.manage("delete", "--job", "cut", "--yes", check=False)
    finally:
        proxy.start()
    assert left.returncode == 1 and "Traceback" not in left.stderr, left.stderr
    said = " ".join(left.stderr.split())
    assert f"job cut is deleted, but its prompt chunks under s3://{BUCKET}/runs (those numbered " \
           f"{last} or lower in cut/prompts/) could not be removed" in said, said
    assert not c.r.keys("dflash:{cut}:*")
    assert st.list("cut/prompts/") == ["cut/prompts/chunk-000001.zst"]
    again, _ = dataset(tmp_path, 30)
    c.manage("enqueue", "--dataset", str(again), "--job", "cut", "--bodies", "storage",
             "--nodes", "elsewhere")  # no GPU here takes it: its prompts stay to be read
    [command] = hints_in(said)
    assert command.startswith("manage.py remove-chunks ")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert "removed from" in paste(command, c.env, elsewhere).stdout  # as pasted, from anywhere
    assert st.list("cut/prompts/") == [f"cut/prompts/chunk-{last + 1:06d}.zst"]
    refs = c.r.hvals("dflash:{cut}:prompts")
    assert len(refs) == 30 and all(bodies.read_frame(st, "cut", ref) for ref in refs)
    assert st.list("cut/batches/"), "shipped batches stay"


def test_bodies_gone_from_under_a_running_worker_hold_its_gpu_and_fail_nothing(cluster, tmp_path):
    """Issue 38, item 7: a storage fault is never the prompt's. Mid-run, the job's chunks vanish
    from the worker's view (their directory renamed away: to a reader, an unmount). Before, each
    prompt the worker took failed at once (prompt_body_missing), and one node drained the job
    into the failed registry; now the GPU holds, `status` says why, nothing fails and no attempt
    is spent, and once the directory is back the job finishes with every row. The deployed
    breaker wait and retry policy (the tests' cluster shortens the retries: set back here)."""
    c = cluster(retry_base_s=2, retry_cap_s=120)
    path, ids = dataset(tmp_path, 400)
    c.manage("enqueue", "--dataset", str(path), "--job", "unmount", "--gpus", "1",
             "--bodies", "storage")
    c.start_server(0, *SIM_ARGS)
    sim_hold(c.url(0))  # the first requests wait for their answers: the run is under way
    c.start_worker(0)
    c.start_beat()
    wait_until(lambda: sim_stats(c.url(0))["requests"] >= 40, timeout=60,
               what="the first requests, their texts read")
    chunks = c.output_dir / "unmount" / bodies.BODIES_DIR
    away = chunks.with_name("prompts-unmounted")
    chunks.rename(away)
    sim_release(c.url(0))

    held = wait_until(lambda: (g := c.status("unmount")["gpus"][c.gpu(0)])["state"] ==
                      "misconfigured" and g, timeout=60, what="the GPU held, with the reason")
    assert "prompt_storage_missing: job unmount: " in held["state_reason"], held
    assert "chunk-000001.zst: no such file" in held["state_reason"], held
    assert "prompt_storage_missing" in c.manage("status", "--job", "unmount").stdout
    snap = c.status("unmount")
    assert snap["failed"] == 0 and 0 < snap["completed"] < len(ids), snap
    assert "circuit open, prompt_storage_missing" in c.workers[0].log()

    # Back: the chunks return beside any a writer stored meanwhile (a generation's entry,
    # kept as a chunk once its round ends).
    chunks.mkdir(exist_ok=True)
    for chunk in away.iterdir():
        chunk.rename(chunks / chunk.name)
    away.rmdir()
    c.wait_done("unmount", timeout=240)
    rows = assert_exactly_once(c, "unmount", ids)
    assert {row["metadata"]["attempts"] for row in rows} == {1}, "a storage fault spends no attempt"
    worker_log = c.workers[0].log()
    assert "unexpected error" not in worker_log
    assert "circuit closed, reads of the prompts' texts work again" in worker_log


def test_a_chunk_garbled_in_place_fails_only_its_garbled_prompts(cluster, tmp_path):
    """Issue 38, item 7: bytes that are there but do not decode (a frame that is not zstd, or
    that does not decompress) are the prompt's loss, not the storage's: those prompts fail for
    good with their own reason, prompt_body_corrupt (before: internal_error), naming the chunk
    and the range; the rest of the job completes and the GPU never stops."""
    c = cluster()
    path, ids = dataset(tmp_path, 60)
    c.manage("enqueue", "--dataset", str(path), "--job", "garbled", "--gpus", "1",
             "--bodies", "storage")
    refs = {pid.decode(): bodies.Reference.parse(ref)
            for pid, ref in c.r.hgetall(JobName("garbled").prompts).items()}
    chunk = c.output_dir / "garbled" / bodies.BODIES_DIR / "chunk-000001.zst"
    size = chunk.stat().st_size
    garble(chunk, refs["p00005"], "zeros")
    garble(chunk, refs["p00017"], "behind the magic")
    assert chunk.stat().st_size == size
    start(c, gpus=(0,))
    c.wait_done("garbled", timeout=120)
    lost = {"p00005", "p00017"}
    check_books(c, "garbled", ids - lost, lost)
    report = json.loads(c.manage("failed", "--job", "garbled", "--json").stdout)
    assert set(report["reasons"]) == {"prompt_body_corrupt"}
    records = [json.loads(v) for v in c.r.hvals(JobName("garbled").failed)]
    assert all(r["class"] == "permanent" and "chunk-000001.zst: bytes " in r["error"]
               for r in records), records
    assert c.status("garbled")["gpus"][c.gpu(0)]["state"] == "serving"
    assert "unexpected error" not in c.workers[0].log()


def test_a_chunk_cut_short_fails_only_its_lost_prompts_at_once(cluster, moto, tmp_path):
    """Issue 27, item 10: an object shorter than its references (on S3: a ranged read past its
    end answers 416, or fewer bytes). Before: retried forever (532 retries after 40 s). Now the
    prompts whose bytes are gone fail at once; the others are generated. Issue 38, item 7: the
    object answers, so its bytes are the prompts' loss, not the storage's fault: their reason is
    prompt_body_corrupt (a chunk not found holds the GPU instead)."""
    c = s3_cluster(cluster, moto.url)
    path, ids = dataset(tmp_path, 40)
    c.manage("enqueue", "--dataset", str(path), "--job", "short", "--gpus", "1", "--bodies", "storage")
    st = storage(moto.url)
    key = "short/prompts/chunk-000001.zst"
    whole = st.get(key)
    st.put(key, whole[:len(whole) // 2])
    refs = {pid.decode(): bodies.Reference.parse(ref)
            for pid, ref in c.r.hgetall("dflash:{short}:prompts").items()}
    lost = {pid for pid, ref in refs.items() if ref.offset + ref.length > len(whole) // 2}
    assert 0 < len(lost) < len(ids)
    start(c, gpus=(0,))
    snap = c.wait_done("short", timeout=120)
    assert snap["failed"] == len(lost) and snap["completed"] == len(ids) - len(lost)
    assert set(json.loads(c.manage("failed", "--job", "short", "--json").stdout)["reasons"]) == \
        {"prompt_body_corrupt"}
    assert {k.decode() for k in c.r.hkeys("dflash:{short}:failed")} == lost
    assert snap["retry_reasons"].get("prompt_storage", 0) == 0


def test_a_node_without_credentials_takes_no_work_and_fails_nothing(cluster, moto, tmp_path):
    """Issue 27, item 10: a GPU worker that cannot read the prompts' texts because S3 refuses
    it (here it has no credentials at all) is the deployment's fault: no prompt fails, the GPU
    says why in status, and a restart with credentials finishes the job."""
    from s3support import AWS_ENV

    c = s3_cluster(cluster, moto.url)
    path, ids = dataset(tmp_path, 30)
    c.manage("enqueue", "--dataset", str(path), "--job", "nocreds", "--gpus", "1",
             "--bodies", "storage")
    c.start_server(0, "--decode-tps", "4000")
    with_creds = dict(c.env)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "DFLASH_S3_URI"):
        c.env.pop(name, None)
    try:
        c.start_worker(0)
    finally:
        c.env = with_creds
    c.start_beat()
    gpu = wait_until(lambda: (g := c.status("nocreds")["gpus"][c.gpu(0)])["state"] ==
                     "misconfigured" and g, timeout=60, what="the GPU shown misconfigured")
    assert "prompt_storage_denied" in gpu["state_reason"] and "no AWS credentials" in \
        gpu["state_reason"], gpu
    assert c.status("nocreds")["failed"] == 0
    c.workers[0].stop()
    assert AWS_ENV["AWS_ACCESS_KEY_ID"] == c.env["AWS_ACCESS_KEY_ID"]
    c.start_worker(0)
    snap = c.wait_done("nocreds", timeout=120)
    assert snap["completed"] == len(ids) and snap["failed"] == 0


def test_beat_and_workers_refuse_s3_settings_they_cannot_use(cluster, moto, tmp_path):
    """Issue 27, item 11: a malformed DFLASH_S3_URI is refused by every command and process,
    naming the variable; beat and workers refuse S3 without credentials, and beat a bucket that
    does not exist."""
    from support import ROOT, python

    c = s3_cluster(cluster, moto.url)
    for command in (["status", "--job", "x"], ["beat"], ["worker", "--gpu", "0"]):
        result = subprocess.run(python("manage.py", *command), cwd=ROOT, capture_output=True,
                                text=True, timeout=60, env={**c.env, "DFLASH_S3_URI": "s3:/bucket"})
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert "DFLASH_S3_URI: not an S3 URI: 's3:/bucket'" in result.stderr, result.stderr
    no_creds = {k: v for k, v in c.env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    beat = c.spawn("beat-nocreds", python("manage.py", "beat"), env=no_creds)
    wait_until(lambda: not beat.alive(), timeout=60, what="beat to refuse")
    assert "no AWS credentials on this node" in beat.log() and beat.popen.returncode != 0
    beat = c.spawn("beat-nobucket", python("manage.py", "beat"),
                   env={**c.env, "DFLASH_S3_URI": "s3://no-such-bucket/x"})
    wait_until(lambda: not beat.alive(), timeout=60, what="beat to refuse")
    assert "there is no bucket no-such-bucket" in beat.log(), beat.log()[-2000:]


def test_enqueue_to_an_unreachable_s3_says_so_and_leaves_nothing(cluster, moto, tmp_path):
    dead = TcpProxy(moto.port)  # never started: connections are refused
    c = s3_cluster(cluster, dead.url)
    c.env.update({"AWS_MAX_ATTEMPTS": "1"})
    path, _ = dataset(tmp_path, 20)
    result = c.manage("enqueue", "--dataset", str(path), "--job", "nope", "--bodies", "storage",
                      check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"s3://{BUCKET}/runs/nope/prompts/chunk-000001.zst" in result.stderr
    assert "job nope not created" in result.stderr
    assert not c.r.keys("dflash:{nope}:*") and not c.r.sismember("dflash:jobs", "nope")


def test_a_dataset_error_before_the_first_chunk_removes_what_was_written(cluster, tmp_path):
    c = cluster()
    path, _ = dataset(tmp_path, 900)  # less than a chunk: nothing is dispatched before the end
    with open(path, "ab") as f:
        f.write(b"\xff\xfe not a line of any encoding\n")  # read fine: a bad row, not an error
    gz = tmp_path / "cut.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes())[:-200])  # truncated: unreadable at the end
    result = c.manage("enqueue", "--dataset", str(gz), "--job", "half", "--bodies", "storage",
                      check=False)
    assert result.returncode == 1 and "cannot read past line" in result.stderr, result.stderr
    assert "job half not created" in result.stderr
    assert not (c.output_dir / "half").exists() or not any((c.output_dir / "half").rglob("*.zst"))
    assert not c.r.keys("dflash:{half}:*")
