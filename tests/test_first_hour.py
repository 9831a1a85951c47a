"""What a new user meets first: the demo's own Redis, tables in an 80-column terminal and in a
pipe, the long-running commands started from another directory, and the messages of a
deployment that is not complete yet. (tests/test_docs_commands.py runs the docs' examples.)"""
from __future__ import annotations

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
    result = subprocess.run([sys.executable, "-m", "dflash_tasks.demo"], cwd=tmp_path,
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
