"""Batches shipped to S3 (moto's server over HTTP), with real Redis, simulated SGLang servers,
and Celery worker and beat subprocesses: every batch arrives with a manifest that matches it,
whatever happens to beat or to S3 along the way, and `manage.py export` proves it."""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from unittest import mock

import pytest
import zstandard
from s3support import (
    AWS_ENV,
    BUCKET,
    TcpProxy,
    assert_shipped_exactly_once,
    progress_in_s3,
    s3_cluster,
    storage,
)
from support import python, wait_until
from test_pipeline import dataset, start

# -- S3Storage on its own ------------------------------------------------------------------------

def test_s3_storage_checksums_multipart_and_clear_errors(moto):
    from dflash_tasks.output.storage import S3Storage, StorageError, StorageNotFound

    with mock.patch.dict(os.environ, {**AWS_ENV, "AWS_ENDPOINT_URL": moto.url}):
        st = S3Storage(f"s3://{BUCKET}/pre/fix", multipart_threshold=5 * 1024 * 1024,
                       multipart_chunksize=5 * 1024 * 1024)
        small, big = b"x" * 1000, os.urandom(11 * 1024 * 1024)
        st.put("job/a.bin", small)
        st.put("job/big.bin", big)
        assert st.get("job/a.bin") == small and st.get("job/big.bin") == big
        assert st.exists("job/a.bin") and not st.exists("job/missing")
        assert st.location("job/a.bin") == f"s3://{BUCKET}/pre/fix/job/a.bin"
        assert sorted(st.list("job/")) == ["job/a.bin", "job/big.bin"]
        with pytest.raises(StorageNotFound):
            st.get("job/missing")

    raw = moto.client()
    head = raw.head_object(Bucket=BUCKET, Key="pre/fix/job/big.bin", ChecksumMode="ENABLED")
    assert head["ETag"].strip('"').endswith("-3")  # three parts: the transfer manager's multipart
    assert head["ChecksumSHA256"]                   # each part sent with its SHA-256
    assert head["Metadata"]["sha256"] == hashlib.sha256(big).hexdigest()
    small_head = raw.head_object(Bucket=BUCKET, Key="pre/fix/job/a.bin")
    assert small_head["Metadata"]["sha256"] == hashlib.sha256(small).hexdigest()

    # Unreachable: a clear error naming the s3:// URL, never the credentials.
    dead = TcpProxy(moto.port)  # never started: connections are refused
    with mock.patch.dict(os.environ, {**AWS_ENV, "AWS_ENDPOINT_URL": dead.url}):
        st = S3Storage(f"s3://{BUCKET}/pre", connect_timeout_s=2, read_timeout_s=5)
        with pytest.raises(StorageError) as err:
            st.put("job/x.bin", b"data")
    message = str(err.value)
    assert f"s3://{BUCKET}/pre/job/x.bin" in message
    assert AWS_ENV["AWS_SECRET_ACCESS_KEY"] not in message
    assert AWS_ENV["AWS_ACCESS_KEY_ID"] not in message


# -- a whole run ---------------------------------------------------------------------------------

def test_run_ships_every_batch_to_s3_with_a_matching_manifest(cluster, moto, tmp_path):
    # A low multipart threshold: the larger batches go up as multipart uploads.
    c = s3_cluster(cluster, moto.url, batch_rows=150, s3_multipart_threshold_bytes=400_000)
    start(c)
    path, ids = dataset(tmp_path, 600)
    c.manage("enqueue", "--dataset", str(path), "--job", "ship", "--gpus", "2")
    c.wait_done("ship")
    st = storage(moto.url)
    manifest, _ = assert_shipped_exactly_once(c, st, "ship", ids)
    assert len(manifest["batches"]) >= 4
    raw = moto.client()
    etags = [raw.head_object(Bucket=BUCKET, Key=f"runs/{rec['key']}")["ETag"]
             for rec in manifest["batches"]]
    assert any("-" in etag for etag in etags), "no batch went up as a multipart upload"
    for rec in manifest["batches"]:
        assert rec["location"] == f"s3://{BUCKET}/runs/{rec['key']}"
        times = [row["metadata"]["completed_at"] for row in _rows_of(st, rec)]
        assert rec["first_completed_at"] == min(times) and rec["last_completed_at"] == max(times)
    # Nothing of the batches stays local; progress.json is in both places, and says done.
    assert not (c.output_dir / "ship" / "batches").exists()
    local = json.loads((c.output_dir / "ship" / "progress.json").read_text())
    remote = progress_in_s3(st, "ship")
    assert local["status"] == remote["status"] == "done"
    assert remote["s3_uploaded"] == len(manifest["batches"])
    assert remote["s3_bytes"] == manifest["bytes"]

    # export downloads and verifies everything ...
    out = c.manage("export", "--job", "ship", "--to", str(tmp_path / "export"))
    assert "verified" in out.stdout and "600 (one per id)" in out.stdout
    exported = sorted((tmp_path / "export" / "batches").iterdir())
    assert [p.name for p in exported] == sorted(f"{rec['name']}.jsonl.zst" for rec in manifest["batches"])
    assert json.loads((tmp_path / "export" / "manifest.json").read_text()) == manifest
    # ... and refuses a dataset whose bytes differ from the manifest's checksum.
    victim = manifest["batches"][1]
    data = zstandard.ZstdDecompressor().decompress(st.get(victim["key"]))
    raw.put_object(Bucket=BUCKET, Key=f"runs/{victim['key']}",
                   Body=zstandard.ZstdCompressor().compress(data.replace(b'"id"', b'"iD"', 1)))
    bad = c.manage("export", "--job", "ship", "--to", str(tmp_path / "export2"), check=False)
    assert bad.returncode != 0 and "sha256" in bad.stderr and victim["name"] in bad.stderr


def _rows_of(st, rec):
    from dflash_tasks.output.batches import read_batch

    return read_batch(st, rec)


# -- crash safety ----------------------------------------------------------------------------------

def test_beat_killed_at_every_step_of_the_upload(cluster, moto, tmp_path):
    """A beat that dies right after each step (tests/crashing_beat.py: os._exit right after the
    call that ends the step, as abrupt as SIGKILL but at an exact point) leaves work the next beat
    finishes, with no row lost or doubled."""
    c = s3_cluster(cluster, moto.url, batch_rows=100, lock_ttl_s=3)
    start(c, beat=False)
    path, ids = dataset(tmp_path, 400)
    c.manage("enqueue", "--dataset", str(path), "--job", "crash", "--gpus", "2")
    wait_until(lambda: c.status("crash")["completed"] == 400, timeout=180, what="400 completions")
    st = storage(moto.url)
    k = "dflash:{crash}:"

    def beat_dies_at(step: str) -> None:
        beat = c.spawn(f"beat-crashing-{step}", python("tests/crashing_beat.py", step))
        wait_until(lambda: not beat.alive(), timeout=120, what=f"beat to crash {step}")
        beat.kill()  # the embedded scheduler is a child process that outlives os._exit: stop it
        assert f"crashing_beat: exiting after {step}" in beat.log(), beat.log()[-3000:]

    def intent() -> dict | None:
        raw = c.r.get(k + "sealing")
        return json.loads(raw) if raw else None

    def in_manifest_json() -> set[str]:
        from dflash_tasks.output.batches import read_manifest

        return {rec["name"] for rec in read_manifest(st, "crash")["batches"]} \
            if st.exists("crash/manifest.json") else set()

    beat_dies_at("after_upload")
    first = intent()["name"]
    assert st.exists(f"crash/batches/{first}.jsonl.zst")
    assert not c.r.hexists(k + "manifest", first) and first not in in_manifest_json()
    assert c.r.xlen(k + "output") == 400

    beat_dies_at("after_record")  # recovery uploads the same batch again, then records it
    assert intent()["name"] == first and c.r.hexists(k + "manifest", first)
    assert first not in in_manifest_json() and c.r.xlen(k + "output") == 400

    beat_dies_at("after_manifest")
    assert intent()["name"] == first and first in in_manifest_json()
    assert c.r.xlen(k + "output") == 400

    beat_dies_at("after_delete")
    assert intent()["name"] == first and c.r.xlen(k + "output") == 300

    beat_dies_at("after_intent")  # the first batch's intent is cleared, the second one set
    second = intent()["name"]
    assert second != first and c.r.xlen(k + "output") == 300
    assert not st.exists(f"crash/batches/{second}.jsonl.zst")

    c.start_beat()
    c.wait_done("crash")
    manifest, _ = assert_shipped_exactly_once(c, st, "crash", ids)
    assert len(manifest["batches"]) == 4
    assert int(c.r.hget(k + "counters", "batches")) == 4  # the batch uploaded twice counted once


def test_s3_unreachable_for_a_while_then_back(cluster, moto, tmp_path):
    proxy = TcpProxy(moto.port).start()
    c = s3_cluster(cluster, proxy.url, batch_rows=100)
    start(c)
    path, ids = dataset(tmp_path, 800)
    c.manage("enqueue", "--dataset", str(path), "--job", "outage", "--gpus", "2")
    progress = c.output_dir / "outage" / "progress.json"
    wait_until(lambda: int(c.r.hget("dflash:{outage}:counters", "s3_uploaded") or 0) >= 1,
               timeout=180, what="a first upload")
    proxy.stop()
    try:
        # Generation goes on; the sealed batches go to beat's spool, not Redis; progress.json
        # (local) keeps coming and shows them and the error.
        def backlog_shown():
            snap = json.loads(progress.read_text())
            return (snap["storage_error"] and snap["completed"] == 800
                    and snap["spooled_batches"] > 0 and snap["unsealed_rows"] == 0 and snap) or None

        snap = wait_until(backlog_shown, timeout=240, interval=0.5, what="the backlog in progress.json")
        assert "s3://" in snap["storage_error"]["error"]
        assert AWS_ENV["AWS_SECRET_ACCESS_KEY"] not in progress.read_text()
        assert snap["status"] == "running"
        stuck = snap["s3_uploaded"]
        later = wait_until(lambda: (s := json.loads(progress.read_text()))["updated_at"]
                           > snap["updated_at"] + 2 and s, timeout=60, what="progress.json to go on")
        assert later["s3_uploaded"] == stuck and later["storage_error"]["failures"] >= 2
    finally:
        proxy.start()
    c.wait_done("outage")
    st = storage(moto.url)
    assert_shipped_exactly_once(c, st, "outage", ids)
    assert json.loads(progress.read_text())["storage_error"] is None
    beat_log = c.beat.log()
    assert beat_log.count("storage failing") <= 2, "one warning per outage, not one per tick"
    assert "Traceback" not in beat_log
    assert "storage works again" in beat_log

    # regenerate --continue reads the shipped batches holding its rows (a plain regenerate reads
    # none: test_regenerate_index.py): with S3 cut it says so and what to do, no traceback, and
    # the done job is left as it was (found by the chaos test).
    assert int(c.r.hget("dflash:{outage}:counters", "finish:length") or 0) > 0
    c.manage("set", "--job", "outage", "--max-output-tokens", "16384")  # room to continue
    proxy.stop()
    try:
        result = c.manage("regenerate", "--job", "outage", "--finish-reason", "length",
                          "--continue", check=False)
        stats = c.manage("stats", "--job", "outage", check=False)  # any command reading batches
    finally:
        proxy.start()
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "S3 download" in result.stderr and "run the same command again" in result.stderr
    assert c.status("outage")["status"] == "done"
    assert stats.returncode == 1 and "Traceback" not in stats.stderr, stats.stderr
    assert "the output storage did not answer" in stats.stderr


def test_two_beats_at_once_corrupt_nothing(cluster, moto, tmp_path, request):
    c = s3_cluster(cluster, moto.url, batch_rows=100, batch_max_age_s=1)
    start(c)
    first = c.beat
    second = c.start_beat()  # an operator starts another one by mistake
    request.addfinalizer(first.stop)  # the cluster fixture stops only the newest beat
    path, ids = dataset(tmp_path, 800)
    c.manage("enqueue", "--dataset", str(path), "--job", "twice", "--gpus", "2")
    progress = c.output_dir / "twice" / "progress.json"
    reads, torn, stop = [0], [], threading.Event()

    def reader():  # reads progress.json as fast as it can while both beats rewrite it
        while not stop.is_set():
            try:
                json.loads(progress.read_text())
                reads[0] += 1
            except FileNotFoundError:
                pass
            except ValueError as exc:
                torn.append(repr(exc))
            time.sleep(0.005)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        c.wait_done("twice")
    finally:
        stop.set()
        thread.join()
    assert reads[0] > 0 and not torn, torn[:3]
    assert first.alive() and second.alive()
    st = storage(moto.url)
    assert_shipped_exactly_once(c, st, "twice", ids)
    assert json.loads(progress.read_text())["status"] == "done"
    assert progress_in_s3(st, "twice")["status"] == "done"
    assert "Traceback" not in first.log() + second.log()
