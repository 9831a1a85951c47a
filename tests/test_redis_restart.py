"""Redis itself fails mid-run: a Redis of the test's own, with append-only persistence fsynced on
every write (docker-compose runs it with AOF), is killed and started again on the same port and
directory while prompts are being generated. Workers and beat reconnect by themselves, no done
mark or row acknowledged before the crash is lost, and every prompt ends in exactly one row."""
from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis

from conftest import Cluster
from failure_support import check_books, dataset, prompts
from support import Proc, free_port, wait_until


class AofRedis:
    def __init__(self, tmp: Path):
        self.port = free_port()
        self.dir = tmp / "redis-aof"
        self.dir.mkdir()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: Proc | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        self.proc = Proc(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                          "--appendonly", "yes", "--appendfsync", "always", "--save", "",
                          "--maxmemory-policy", "noeviction", "--dir", str(self.dir)],
                         self.dir / f"redis-{self.starts}.log")
        client = redis.Redis.from_url(self.url)
        wait_until(lambda: client.ping(), timeout=30, what="redis-server to load its AOF")

    def crash(self) -> None:
        """SIGKILL: no shutdown save, nothing flushed beyond what AOF already fsynced."""
        assert self.proc is not None
        self.proc._signal(signal.SIGKILL)
        self.proc.popen.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


@pytest.fixture
def aof_redis(tmp_path):
    server = AofRedis(tmp_path)
    server.start()
    yield server
    server.stop()


def test_redis_restart_mid_run_loses_and_doubles_nothing(aof_redis, tmp_path):
    c = Cluster(tmp_path, aof_redis.url, visibility_timeout_s=20, reap_after_s=600,
                lost_message_grace_s=20, redis_outage_s=120)
    try:
        c.start_server(0, "--slots", "40", "--decode-tps", "1500")
        worker = c.start_worker(0)
        beat = c.start_beat()
        rows = prompts(600)
        c.manage("enqueue", "--dataset", str(dataset(tmp_path, rows)), "--job", "redis",
                 "--max-output-tokens", "2048")
        wait_until(lambda: c.status("redis")["completed"] >= 150, timeout=120,
                   what="150 completions")

        done_before = c.r.scard("dflash:{redis}:done")
        counted_before = int(c.r.hget("dflash:{redis}:counters", "completed"))
        aof_redis.crash()
        time.sleep(3)  # workers and beat see a dead Redis, in-flight generations go on
        aof_redis.start()
        # Everything acknowledged before the crash is still there (appendfsync always).
        assert c.r.scard("dflash:{redis}:done") >= done_before
        assert int(c.r.hget("dflash:{redis}:counters", "completed")) >= counted_before

        c.wait_done("redis", timeout=300)
        check_books(c, "redis", {r["id"] for r in rows})
        assert worker.alive() and beat.alive()  # reconnected by themselves
        for proc in (worker, beat):
            assert "Unrecoverable error" not in proc.log()
    finally:
        c.stop()


def test_aof_redis_fixture_really_persists(aof_redis):
    """The crash is a real one: a write acknowledged just before SIGKILL survives it."""
    r = redis.Redis.from_url(aof_redis.url)
    r.set("k", "v")
    aof_redis.crash()
    aof_redis.start()
    assert r.get("k") == b"v"
    assert subprocess.run(["redis-cli", "-p", str(aof_redis.port), "config", "get", "appendonly"],
                          capture_output=True, text=True).stdout.split()[-1] == "yes"
