"""What a new user meets first: the demo's own Redis, tables in an 80-column terminal and in a
pipe, the long-running commands started from another directory, and the messages of a
deployment that is not complete yet. (tests/test_docs_commands.py runs the docs' examples.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import redis


def test_demo_starts_its_own_redis_and_never_touches_the_one_configured(redis_url, tmp_path):
    """A Redis that answers at DFLASH_REDIS_URL may be a live deployment's: its workers would
    take the demo's queues and write simulated rows into real jobs. Run from another directory."""
    r = redis.Redis.from_url(redis_url)
    r.set("live-deployment", "mine")
    before = r.info("stats")["total_connections_received"]
    result = subprocess.run([sys.executable, "-m", "dflash_dev.demo"], cwd=tmp_path,
                            env={**os.environ, "DFLASH_REDIS_URL": redis_url},
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Redis: started the demo's own redis-server at redis://127.0.0.1:" in result.stdout
    assert f"DFLASH_REDIS_URL={redis_url} is not used" in result.stdout
    assert "export of job demo: verified" in result.stdout, result.stdout[-2000:]
    # Not one connection from the demo or its children, and nothing written.
    assert r.info("stats")["total_connections_received"] == before
    assert r.keys("*") == [b"live-deployment"]
    assert (tmp_path / "output" / "demo" / "progress.json").exists()


def _manage(env, *args):
    result = subprocess.run([os.path.join(os.path.dirname(sys.executable), "manage.py"), *args],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"manage.py {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_tables_read_at_80_columns_and_piped(redis_url, tmp_path):
    """status, failed and train-status piped (rich then renders at COLUMNS) in 80 columns: no
    line is wider, no cell is cut to "…", a figure keeps its unit, a long error and a long run
    name are there whole, and what does not fit is named."""
    from rich.cells import cell_len

    from dflash_tasks.core.keys import JobName
    from dflash_tasks.ledger import Ledger

    env = {**os.environ, "DFLASH_REDIS_URL": redis_url, "DFLASH_OUTPUT_DIR": str(tmp_path / "out"),
           "COLUMNS": "80"}
    job = "qwen3-8b-thinking-long-job-name"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _manage(env, "enqueue", "--dataset", os.path.join(root, "examples", "prompts.jsonl"),
            "--job", job, "--gpus", "2", "--limit", "30")
    r = redis.Redis.from_url(redis_url)
    error = ("The input (9,001 tokens) is longer than the model's context length (8,192 tokens). "
             * 5 + "THE-END-OF-THE-ERROR")
    ids = [i.decode() for i in r.lrange(JobName(job).pending, 0, 2)]  # no worker takes them
    assert len(ids) == 3, ids
    for n, pid in enumerate(ids):
        assert Ledger(r).fail(JobName(job), pid, "gpu0@a", {
            "id": pid, "reason": "invalid_request", "class": "permanent",
            "error": error if n < 2 else "short", "status": 400, "attempts": 1, "gpu": "gpu0@a",
            "at": 1.7e9 + n})
    (tmp_path / "train.toml").write_text('[reference]\ntarget_model = "/models/Qwen3-8B"\n')
    for _ in range(2):
        _manage(env, "train", "--job", job, "--after-done", "--config", str(tmp_path / "train.toml"))

    outputs = {cmd: _manage(env, *cmd.split(), "--job", job) for cmd in ("status", "failed")}
    outputs["train-status"] = _manage(env, "train-status")
    for cmd, out in outputs.items():
        wide = [line for line in out.splitlines() if cell_len(line) > 80]
        assert not wide, f"{cmd}: lines over 80 columns:\n" + "\n".join(wide)
        assert "…" not in out, f"{cmd} cut a cell:\n{out}"

    progress = next(line for line in outputs["status"].splitlines() if "progress" in line)
    assert "/30 (" in progress and ("eta -" in progress or progress.rstrip().endswith(" h")), \
        outputs["status"]
    assert "retry wait" in outputs["status"]

    failed = outputs["failed"]
    flat = " ".join(line.strip() for line in failed.splitlines())
    assert error in flat, failed  # whole, wrapped in its own lines
    assert flat.count("THE-END-OF-THE-ERROR") == 1 and "(the same error)" in flat
    assert all(pid in failed for pid in ids)

    listing = outputs["train-status"]
    assert f"{job}-train-1" in listing and f"{job}-train-2" in listing, listing
    assert "not shown at 80 columns" in listing and "--json" in listing
    whole = json.loads(_manage(env, "train-status", "--json"))
    assert {run["run"] for run in whole} == {f"{job}-train-1", f"{job}-train-2"}


def test_generation_parameters_out_of_range_are_refused_naming_the_option_and_its_range(redis_url):
    """A cap of a billion tokens or a temperature of 1e9 would fail every prompt at the servers:
    enqueue and set refuse them (exit 2) and change nothing."""
    env = {**os.environ, "DFLASH_REDIS_URL": redis_url}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    manage = os.path.join(os.path.dirname(sys.executable), "manage.py")
    dataset = os.path.join(root, "examples", "prompts.jsonl")
    r = redis.Redis.from_url(redis_url)
    cases = [("--max-output-tokens", "1000000000", "1<=x<=131072"),
             ("--temperature", "1e9", "0<=x<=2"), ("--temperature", "nan", "finite"),
             ("--top-p", "1.5", "0<x<=1"), ("--top-k", "0", "-1 (off) or at least 1")]
    for option, value, said in cases:
        result = subprocess.run([manage, "enqueue", "--dataset", dataset, "--job", "j", "--gpus", "1",
                                 option, value], env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and option in result.stderr and said in result.stderr, \
            (option, value, result.stderr)
        assert r.keys("*") == []  # nothing was created
    _manage(env, "enqueue", "--dataset", dataset, "--job", "j", "--gpus", "1", "--limit", "2",
            "--max-output-tokens", "131072", "--temperature", "2")
    before = json.loads(_manage(env, "status", "--job", "j", "--json"))["params"]
    assert (before["max_tokens"], before["temperature"]) == (131072, 2.0)
    for option, value, said in cases:
        result = subprocess.run([manage, "set", "--job", "j", option, value], env=env,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and option in result.stderr and said in result.stderr
    assert json.loads(_manage(env, "status", "--job", "j", "--json"))["params"] == before


def test_stored_files_are_readable_as_any_other_file_of_the_process(tmp_path):
    """Batches, manifests and progress.json (LocalStorage.put, through mkstemp) were 0600: a
    training job running as another user could not read them."""
    from dflash_tasks.output.storage import LocalStorage

    umask = os.umask(0o022)
    os.umask(umask)
    LocalStorage(tmp_path).put("job/batches/batch-1-0.jsonl.zst", b"rows")
    LocalStorage(tmp_path).put("job/manifest.json", b"{}")
    for path in ("job/batches/batch-1-0.jsonl.zst", "job/manifest.json"):
        assert (tmp_path / path).stat().st_mode & 0o777 == 0o666 & ~umask, path


def test_a_worker_waiting_for_its_server_says_so_once_a_minute(redis_url, tmp_path):
    """A server loading a model takes minutes: the worker's "waiting for SGLang" line used to
    repeat every 2 s (336 lines in 11 minutes)."""
    import time

    from conftest import Cluster
    from support import Proc, free_port, python, wait_until

    c = Cluster(tmp_path, redis_url)
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    worker = Proc(python("manage.py", "worker", "--gpu", "0", "--sglang-url", closed,
                         "--concurrency", "2"), tmp_path / "worker.log", env=c.env)
    try:
        wait_until(lambda: "waiting for SGLang" in worker.log(), timeout=60,
                   what="the first waiting line")
        time.sleep(8)  # four more polls of /health: the time it covers is what is checked
        assert worker.log().count("waiting for SGLang") == 1, worker.log()[-2000:]
    finally:
        worker.stop()


def test_status_says_when_beat_is_not_running(redis_url, tmp_path):
    """Workers without beat (launch_node.py starts none) generate rows that nothing seals: the
    job stayed "running" with rows waiting and no hint. status now says what is missing."""
    from conftest import Cluster, write_jsonl
    from support import wait_until

    c = Cluster(tmp_path, redis_url)
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": f"b{i}", "prompt": f"q {i}"} for i in range(5)])
    c.manage("enqueue", "--dataset", str(data), "--job", "nobeat")
    out = " ".join(c.manage("status", "--job", "nobeat").stdout.split())
    assert "no tick ever" in out and "start `manage.py beat`" in out
    assert c.status("nobeat")["beat_age_s"] is None
    try:
        c.start_beat()
        wait_until(lambda: c.status("nobeat")["beat_age_s"] is not None, timeout=30,
                   what="beat's first tick")
        assert "manage.py beat" not in c.manage("status", "--job", "nobeat").stdout
    finally:
        c.stop()
