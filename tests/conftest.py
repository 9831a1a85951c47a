"""Fixtures that start the real thing: Redis (a test database, or a server of the test's own),
simulated SGLang servers, Celery workers and beat, each a subprocess with its own log."""
from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
import redis
from support import Proc, free_port, python, wait_until


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> str:
    """A redis-server of this test session's own on a free port: tests never touch the
    machine's Redis, and two test runs on one machine never see each other's queues. It
    persists as deployed (AOF, fsync every second), which workers and beat require.
    DFLASH_TEST_REDIS_URL points the tests at an existing server instead."""
    if url := os.environ.get("DFLASH_TEST_REDIS_URL"):
        yield url
        return
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = Proc(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(workdir)],
                workdir / "redis.log")
    url = f"redis://127.0.0.1:{port}/0"
    wait_until(lambda: redis.Redis.from_url(url).ping(), timeout=20, what="the test redis-server")
    yield url
    proc.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """An empty Redis database for this test."""
    r = redis.Redis.from_url(redis_server)
    r.flushdb()
    yield redis_server
    r.flushdb()


class Cluster:
    """A one-machine deployment: N simulated servers, one pinned worker each, and beat."""

    def __init__(self, tmp: Path, redis_url: str, **settings: str):
        self.tmp = tmp
        self.output_dir = tmp / "output"
        self.env = {
            "DFLASH_REDIS_URL": redis_url,
            "DFLASH_OUTPUT_DIR": str(self.output_dir),
            "DFLASH_PROGRESS_INTERVAL_S": "1",
            "DFLASH_BATCH_ROWS": "200",
            "DFLASH_BATCH_MAX_AGE_S": "2",
            "DFLASH_RETRY_BASE_S": "0.2",
            "DFLASH_RETRY_CAP_S": "2",
            # A Redis the tests did not start (DFLASH_TEST_REDIS_URL) may persist nothing.
            **({"DFLASH_ALLOW_NO_PERSISTENCE": "1"} if os.environ.get("DFLASH_TEST_REDIS_URL") else {}),
            **{f"DFLASH_{k.upper()}": str(v) for k, v in settings.items()},
        }
        self.r = redis.Redis.from_url(redis_url)
        self.servers: dict[int, tuple[int, Proc]] = {}
        self.workers: dict[int, Proc] = {}
        self.beat: Proc | None = None
        self.train_workers: list[Proc] = []
        self._n = 0

    def _log(self, name: str) -> Path:
        self._n += 1
        return self.tmp / "logs" / f"{self._n:02d}-{name}.log"

    def start_server(self, gpu: int, *args: str, port: int | None = None) -> int:
        port = port or free_port()
        proc = Proc(python("-m", "dflash_dev.sim", "--port", str(port), *args),
                    self._log(f"sim{gpu}"))
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200,
                   timeout=30, what=f"simulated server gpu{gpu} on port {port}")
        self.servers[gpu] = (port, proc)
        return port

    def url(self, gpu: int) -> str:
        return f"http://127.0.0.1:{self.servers[gpu][0]}"

    def start_worker(self, gpu: int, *args: str) -> Proc:
        proc = Proc(python("manage.py", "worker", "--gpu", str(gpu), "--sglang-url", self.url(gpu),
                           *args), self._log(f"worker{gpu}"), env=self.env)
        wait_until(lambda: self.r.hexists("dflash:workers", f"gpu{gpu}") or not proc.alive(),
                   timeout=60, what=f"worker gpu{gpu} to register")
        assert proc.alive(), proc.log()
        self.workers[gpu] = proc
        return proc

    def start_train_worker(self) -> Proc:
        """The training worker (`worker --queue train`); ready once Celery says so in its log."""
        proc = Proc(python("manage.py", "worker", "--queue", "train"), self._log("train-worker"),
                    env=self.env)
        wait_until(lambda: "ready." in proc.log() or not proc.alive(), timeout=60,
                   what="the training worker to start")
        assert proc.alive(), proc.log()
        self.train_workers.append(proc)
        return proc

    def start_beat(self) -> Proc:
        """Beat and its control worker; returns once that worker is ready, so a test that
        enqueues next sees ticks from the start (on a loaded machine start-up takes seconds)."""
        self.beat = Proc(python("manage.py", "beat"), self._log("beat"), env=self.env)
        wait_until(lambda: "ready." in self.beat.log() or not self.beat.alive(), timeout=60,
                   what="beat's control worker to start")
        assert self.beat.alive(), self.beat.log()
        return self.beat

    def manage(self, *args: str, check: bool = True):
        import subprocess

        result = subprocess.run(python("manage.py", *args), env={**os.environ, **self.env},
                                capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent)
        if check and result.returncode != 0:
            raise AssertionError(f"manage.py {' '.join(args)} failed ({result.returncode}):\n"
                                 f"{result.stdout}\n{result.stderr}")
        return result

    def status(self, job: str) -> dict:
        return json.loads(self.manage("status", "--job", job, "--json").stdout)

    def wait_done(self, job: str, timeout: float = 300) -> dict:
        return wait_until(lambda: (s := self.status(job))["status"] == "done" and s,
                          timeout=timeout, interval=0.5, what=f"job {job} to be done")

    def rows(self, job: str) -> list[dict]:
        from dflash_tasks.output.batches import read_batch, read_manifest
        from dflash_tasks.output.storage import LocalStorage

        storage = LocalStorage(self.output_dir)
        manifest = read_manifest(storage, job)
        return [row for record in manifest["batches"] for row in read_batch(storage, record)]

    def stop(self) -> None:
        for proc in [*self.train_workers, *self.workers.values(), *([self.beat] if self.beat else []),
                     *(p for _, p in self.servers.values())]:
            proc.stop()


@pytest.fixture
def cluster(tmp_path, redis_url):
    clusters: list[Cluster] = []

    def make(**settings) -> Cluster:
        c = Cluster(tmp_path, redis_url, **settings)
        clusters.append(c)
        return c

    yield make
    for c in clusters:
        c.stop()


@pytest.fixture
def moto(tmp_path):
    """moto's S3 server over HTTP, with the tests' bucket (s3support.py)."""
    from s3support import MotoServer

    server = MotoServer(tmp_path / "logs" / "00-moto.log")
    server.create_bucket()
    yield server
    server.stop()


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


# The longest files first, so that with pytest-xdist (make test: --dist loadfile) they do not
# start last and leave the other workers idle at the end. Seconds measured on 2 cores.
LONGEST_FIRST = ["test_chaos.py", "test_operate.py", "test_failures.py",  # ~200 s each
                 "test_train_reference_queue.py", "test_s3_batches.py", "test_pipeline.py",
                 "test_training_reference.py", "test_train_queue.py", "test_training_data.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within a file kept
