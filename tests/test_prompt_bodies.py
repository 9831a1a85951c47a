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
from s3support import BUCKET, TcpProxy, assert_shipped_exactly_once, s3_cluster, storage
from support import wait_until
from test_pipeline import assert_exactly_once, dataset, start

from dflash_tasks.core import jobs
from dflash_tasks.core.keys import JobName
from dflash_tasks.core.settings import Settings
from dflash_tasks.ingest.loader import PromptLoader
from dflash_tasks.ingest.prompts import Prompt
from dflash_tasks.ledger import Ledger, bodies
from dflash_tasks.ledger.messages import decode_messages
from dflash_tasks.output.storage import LocalStorage, StorageError, StorageNotFound


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
    assert not (c.output_dir / "local" / bodies.BODIES_DIR).exists()
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

    # delete with S3 cut: refused, the job as it was; then, S3 back, the job and its chunk go.
    keys = sorted(c.r.keys("dflash:{cut}:*"))
    proxy.stop()
    try:
        refused = c.manage("delete", "--job", "cut", "--yes", check=False)
    finally:
        proxy.start()
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert "nothing was deleted: run delete again when the storage answers" in refused.stderr
    assert sorted(c.r.keys("dflash:{cut}:*")) == keys
    c.manage("delete", "--job", "cut", "--yes")
    assert st.list("cut/prompts/") == [] and not c.r.keys("dflash:{cut}:*")
    assert st.list("cut/batches/"), "shipped batches stay"


def test_a_chunk_gone_fails_its_prompts_for_good_with_the_reason(cluster, tmp_path):
    c = cluster()
    path, ids = dataset(tmp_path, 50)
    c.manage("enqueue", "--dataset", str(path), "--job", "gone", "--gpus", "1", "--bodies", "storage")
    (c.output_dir / "gone" / bodies.BODIES_DIR / "chunk-000001.zst").unlink()
    start(c, gpus=(0,), beat=False)
    wait_until(lambda: int(c.r.hget("dflash:{gone}:counters", "failed") or 0) == 50, timeout=120,
               what="every prompt of the lost chunk to fail")
    records = [json.loads(v) for v in c.r.hvals("dflash:{gone}:failed")]
    assert {r["reason"] for r in records} == {"prompt_body_missing"}
    assert all("chunk-000001.zst" in r["error"] and r["class"] == "permanent" for r in records)


def test_a_chunk_cut_short_fails_only_its_lost_prompts_at_once(cluster, moto, tmp_path):
    """Issue 27, item 10: an object shorter than its references (on S3: a ranged read past its
    end answers 416, or fewer bytes). Before: retried forever (532 retries after 40 s). Now the
    prompts whose bytes are gone fail at once, prompt_body_missing; the others are generated."""
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
        {"prompt_body_missing"}
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
