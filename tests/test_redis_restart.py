"""Redis itself fails mid-run: a Redis of the test's own, with append-only persistence as
docker-compose runs it (fsync every second), is killed and started again on the same port and
directory while prompts are being generated and retries wait. Workers and beat reconnect by
themselves, recover within seconds, and every prompt ends in exactly one row."""
from __future__ import annotations

import subprocess
import time

import redis
from conftest import Cluster
from failure_support import check_books, counters, dataset, prompts
from support import AofRedis, wait_until

from dflash_tasks.core.keys import JobName


def test_redis_restart_while_retries_wait_recovers_in_seconds_with_the_deployed_settings(aof_redis, tmp_path):
    """Issue 14, problem 1: 600 prompts, 15% of requests answered 503, Redis (AOF, fsync every
    second) killed while retries wait for their backoff, workers and beat left running. Before
    the fix the job hung at 599/600 for the visibility timeout (4 h): Celery forgets a waiting
    retry with its lost connection while its message sits in `unacked`. Everything here is as
    deployed (visibility timeout, appendfsync, retry policy, maintain period, lost-message
    grace) except the test's short batch age."""
    c = Cluster(tmp_path, aof_redis.url, retry_base_s=2.0, retry_cap_s=120.0)
    try:
        c.start_server(0, "--slots", "40", "--decode-tps", "1500", "--fail-503", "0.15", "--seed", "7")
        worker = c.start_worker(0)
        beat = c.start_beat()
        rows = prompts(600)
        c.manage("enqueue", "--dataset", str(dataset(tmp_path, rows)), "--job", "redis",
                 "--max-output-tokens", "2048")
        # Crashed while a retry waits in the worker for a second more at least, noted more than
        # appendfsync's second before (its unacknowledged message on disk): read from Redis just
        # before the crash (one seen through `status` could have run meanwhile, leaving nothing
        # for the reconnect to restore).
        job = JobName("redis")

        def retry_waiting_on_disk() -> bool:
            now = time.time()
            later = c.r.zrangebyscore(job.retrying(c.gpu(0)), now + 1.0, "+inf")
            noted = c.r.zmscore(job.inflight(c.gpu(0)), later) if later else []
            return any(at is not None and at <= now - 1.5 for at in noted)

        wait_until(lambda: counters(c, "redis").get("completed", 0) >= 150
                   and retry_waiting_on_disk(),
                   timeout=180, interval=0.02, what="150 completions and a retry waiting")

        done_before = c.r.scard("dflash:{redis}:done")
        aof_redis.crash()
        time.sleep(3)  # the outage: workers and beat see a dead Redis, generations go on
        aof_redis.start()
        restarted = time.monotonic()
        # appendfsync everysec: at most the last second before the crash is gone.
        assert c.r.scard("dflash:{redis}:done") >= done_before - 200

        c.wait_done("redis", timeout=240)
        took = time.monotonic() - restarted
        check_books(c, "redis", {r["id"] for r in rows})
        assert took < 180, f"done {took:.0f}s after the restart"
        assert "back in the queue" in worker.log()  # its waiting retries, restored on reconnect
        assert worker.alive() and beat.alive()  # reconnected by themselves
        for proc in (worker, beat):
            assert "Unrecoverable error" not in proc.log()
    finally:
        c.stop()


def test_aof_redis_really_persists(tmp_path):
    """The crash is a real one, and the restart reads the data back: with fsync on every write
    (not the deployed everysec, whose last second a SIGKILL may lose), a write acknowledged just
    before SIGKILL survives it."""
    server = AofRedis(tmp_path, appendfsync="always")
    server.start()
    try:
        r = redis.Redis.from_url(server.url)
        r.set("k", "v")
        server.crash()
        server.start()
        assert r.get("k") == b"v"
        assert subprocess.run(["redis-cli", "-p", str(server.port), "config", "get", "appendonly"],
                              capture_output=True, text=True).stdout.split()[-1] == "yes"
    finally:
        server.stop()
