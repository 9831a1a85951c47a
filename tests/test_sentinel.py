"""Redis high availability with Redis Sentinel: a master, a replica and three sentinels of the
test's own, all real processes. The master is SIGKILLed mid-run; the sentinels promote the
replica, and the workers, beat and the CLI, configured with sentinel:// URLs only, follow the
new master by themselves. Every prompt ends in exactly one row. Also: the settings read a
Sentinel URL the way kombu and Celery do, and never show a password."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest
import redis
from conftest import Cluster
from failure_support import check_books, dataset, prompts
from support import Proc, free_port, wait_until

from dflash_tasks.core.settings import Settings, redact_url, sentinel_nodes

MASTER_NAME = "mymaster"
PASSWORD, SENTINEL_PASSWORD = "redis-secret", "sentinel-secret"


class SentinelRedis:
    """A master and a replica (append-only, fsync every second, as deployed) and three
    sentinels (quorum 2), each on a free port with its own directory under `tmp`. The servers
    and the sentinels each have a password of their own."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        tmp.mkdir()
        self.master_port, self.replica_port = free_port(), free_port()
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.procs: dict[str, Proc] = {}

    @property
    def url(self) -> str:
        return ";".join(f"sentinel://127.0.0.1:{port}/0" for port in self.sentinel_ports)

    def _redis(self, name: str, port: int, *args: str) -> None:
        workdir = self.tmp / name
        workdir.mkdir()
        self.procs[name] = Proc(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                                 "--dir", str(workdir), "--appendonly", "yes",
                                 "--appendfsync", "everysec", "--save", "",
                                 "--maxmemory-policy", "noeviction", "--requirepass", PASSWORD,
                                 "--masterauth", PASSWORD, *args], workdir / "redis.log")
        client = redis.Redis(port=port, password=PASSWORD)
        wait_until(client.ping, timeout=30, what=f"{name} redis-server")

    def start(self) -> None:
        self._redis("master", self.master_port)
        self._redis("replica", self.replica_port, "--replicaof", "127.0.0.1", str(self.master_port))
        for i, port in enumerate(self.sentinel_ports):
            workdir = self.tmp / f"sentinel{i}"
            workdir.mkdir()
            conf = workdir / "sentinel.conf"  # a sentinel rewrites its own config file
            # Detection and failover timings shortened so the test fails over within seconds
            # (production's defaults: 30 s to call the master down, 3 min failover timeout).
            conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {workdir}\n"
                            f"requirepass {SENTINEL_PASSWORD}\n"
                            f"sentinel sentinel-pass {SENTINEL_PASSWORD}\n"
                            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master_port} 2\n"
                            f"sentinel auth-pass {MASTER_NAME} {PASSWORD}\n"
                            f"sentinel down-after-milliseconds {MASTER_NAME} 1000\n"
                            f"sentinel failover-timeout {MASTER_NAME} 10000\n")
            self.procs[f"sentinel{i}"] = Proc(["redis-server", str(conf), "--sentinel"],
                                              workdir / "sentinel.log")
        # Ready when each sentinel knows the replica and the two other sentinels (they find
        # each other through the master's hello channel, every 2 s): a failover needs a quorum.
        wait_until(lambda: all(int(m["num-slaves"]) == 1 and int(m["num-other-sentinels"]) == 2
                               for m in map(self._master_info, self.sentinel_ports)),
                   timeout=60, interval=0.2, what="the sentinels to know the replica and each other")

    def _master_info(self, port: int) -> dict:
        return self._sentinel(port, decode_responses=True).sentinel_master(MASTER_NAME)

    @staticmethod
    def _sentinel(port: int, **kwargs) -> redis.Redis:
        return redis.Redis(port=port, password=SENTINEL_PASSWORD, **kwargs)

    def master_port_now(self) -> int:
        """The master's port as a majority of the sentinels see it."""
        ports = [int(self._sentinel(p).sentinel_get_master_addr_by_name(MASTER_NAME)[1])
                 for p in self.sentinel_ports]
        return max(set(ports), key=ports.count)

    def kill_master(self) -> None:
        proc = self.procs["master"]
        proc._signal(signal.SIGKILL)
        proc.popen.wait(timeout=30)

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop()


@pytest.fixture
def sentinels(tmp_path):
    deployment = SentinelRedis(tmp_path / "ha")
    deployment.start()
    yield deployment
    deployment.stop()


def test_a_master_killed_mid_run_fails_over_and_every_prompt_ends_in_one_row(sentinels, tmp_path):
    """400 prompts; the master SIGKILLed after 100 rows; the sentinels promote the replica.
    Workers, beat and the CLI know only the sentinels' addresses and the passwords; none is
    restarted. Rows wait for the replica (DFLASH_REDIS_WAIT_REPLICAS=1), until there is none
    left to wait for."""
    c = Cluster(tmp_path, sentinels.url, redis_password=PASSWORD,
                redis_sentinel_password=SENTINEL_PASSWORD, redis_wait_replicas=1,
                redis_wait_timeout_ms=200)
    try:
        c.start_server(0, "--slots", "40", "--decode-tps", "500", "--median-tokens", "400")
        worker = c.start_worker(0)
        beat = c.start_beat()
        rows = prompts(400)
        c.manage("enqueue", "--dataset", str(dataset(tmp_path, rows)), "--job", "ha",
                 "--max-output-tokens", "1024")
        wait_until(lambda: c.status("ha")["completed"] >= 100, timeout=120, interval=0.2,
                   what="100 completions")

        sentinels.kill_master()
        wait_until(lambda: sentinels.master_port_now() == sentinels.replica_port, timeout=60,
                   interval=0.2, what="the sentinels to promote the replica")

        c.wait_done("ha", timeout=180)
        check_books(c, "ha", {r["id"] for r in rows})
        assert c.r.connection_pool.get_master_address()[1] == sentinels.replica_port
        assert worker.alive() and beat.alive()  # followed the new master by themselves
        for proc in (worker, beat):
            assert "Unrecoverable error" not in proc.log()
            assert PASSWORD not in proc.log() and SENTINEL_PASSWORD not in proc.log()
        # With no replica left, rows go on after the WAIT's timeout, and the worker says why.
        assert "reached 0 of 1 replica(s)" in worker.log()
    finally:
        c.stop()


def test_sentinel_urls_are_read_as_kombu_and_celery_read_them_and_never_show_a_password(monkeypatch):
    assert sentinel_nodes("redis://127.0.0.1:6379/0") is None
    assert sentinel_nodes("sentinel://a:26380;sentinel://b") == ([("a", 26380), ("b", 26379)], 0)
    assert sentinel_nodes("sentinel://a/2;sentinel://b/2") == ([("a", 26379), ("b", 26379)], 2)
    # kombu reads the db of the sentinel it connects through, Celery the first one's
    with pytest.raises(ValueError, match="same db on every sentinel"):
        sentinel_nodes("sentinel://a;sentinel://b/2")
    with pytest.raises(ValueError, match="sentinel://host"):
        sentinel_nodes("sentinel://a;redis://b")

    monkeypatch.setenv("DFLASH_REDIS_URL", "sentinel://:hunter2@a:26379;sentinel://b:26379")
    with pytest.raises(ValueError) as refused:
        Settings()
    assert "DFLASH_REDIS_PASSWORD" in str(refused.value) and "hunter2" not in str(refused.value)

    monkeypatch.setenv("DFLASH_REDIS_URL", "sentinel://a:26379;sentinel://b:26379/0")
    monkeypatch.setenv("DFLASH_REDIS_PASSWORD", "hunter2")
    monkeypatch.setenv("DFLASH_REDIS_SENTINEL_PASSWORD", "s3cret")
    s = Settings()
    assert s.redis_master_name == "mymaster" and s.redis_wait_replicas == 0
    assert "hunter2" not in repr(s) and "s3cret" not in repr(s)
    assert s.sentinel_kwargs()["password"] == "s3cret"

    assert redact_url("sentinel://:pw@a:26379;sentinel://u:pw2@b:26380/0") == \
        "sentinel://:***@a:26379;sentinel://u:***@b:26380/0"
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
