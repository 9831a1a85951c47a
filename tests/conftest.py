"""Fixtures that start the real thing: Redis (a test database, or a server of the test's own),
simulated SGLang servers, Celery workers and beat (dflash_dev's LocalCluster), each a subprocess
with its own log."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import redis
from support import ROOT, AofRedis, Proc, free_port, python, wait_until

from dflash_dev.local import LocalCluster
from dflash_tasks.output.batches import read_batch, read_manifest
from dflash_tasks.output.storage import LocalStorage


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


class Cluster(LocalCluster):
    """The tests' deployment: dflash_dev's LocalCluster on the tests' Redis, with settings that
    make a run short (ticks every second, small batches, short retry waits), and the checks the
    tests read it through."""

    def __init__(self, tmp: Path, redis_url: str, **settings: str):
        self.tmp = tmp
        self.output_dir = tmp / "output"
        super().__init__(tmp / "logs", env={
            "DFLASH_REDIS_URL": redis_url,
            "DFLASH_OUTPUT_DIR": str(self.output_dir),
            "DFLASH_PROGRESS_INTERVAL_S": "1",
            "DFLASH_BATCH_ROWS": "200",
            "DFLASH_BATCH_MAX_AGE_S": "2",
            "DFLASH_RETRY_BASE_S": "0.2",
            "DFLASH_RETRY_CAP_S": "2",
            "HF_HUB_OFFLINE": "1",  # nothing a test runs reaches the Hugging Face hub
            # A Redis the tests did not start (DFLASH_TEST_REDIS_URL) may persist nothing.
            **({"DFLASH_ALLOW_NO_PERSISTENCE": "1"} if os.environ.get("DFLASH_TEST_REDIS_URL") else {}),
            **{f"DFLASH_{k.upper()}": str(v) for k, v in settings.items()},
        })
        self.r = self._redis()

    def manage(self, *args: str, check: bool = True):
        """manage.py's result, its output captured; a failure (with check) shows both streams."""
        result = subprocess.run(python("manage.py", *args), env=self.env, capture_output=True,
                                text=True, timeout=300, cwd=ROOT)
        if check and result.returncode != 0:
            raise AssertionError(f"manage.py {' '.join(args)} failed ({result.returncode}):\n"
                                 f"{result.stdout}\n{result.stderr}")
        return result

    def status(self, job: str) -> dict:
        return json.loads(self.manage("status", "--job", job, "--json").stdout)

    def wait_done(self, job: str, timeout: float = 300) -> dict:
        seen: dict = {}

        def done():
            seen.update(self.status(job))
            return seen["status"] == "done" and dict(seen)

        try:
            return wait_until(done, timeout=timeout, interval=0.5, what=f"job {job} to be done")
        except TimeoutError as exc:  # what it was waiting on, for a failure seen only in CI
            counts = {k: v for k, v in seen.items() if not isinstance(v, (dict, list))}
            raise TimeoutError(f"{exc}; its status last: {counts}") from None

    def rows(self, job: str) -> list[dict]:
        storage = LocalStorage(self.output_dir)
        manifest = read_manifest(storage, job)
        return [row for record in manifest["batches"] for row in read_batch(storage, record)]


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
def aof_redis(tmp_path):
    """A Redis of the test's own that can be crashed and started again on its data
    (support.AofRedis), persisting as deployed: append-only, fsync every second."""
    server = AofRedis(tmp_path, appendfsync="everysec")
    server.start()
    yield server
    server.stop()


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
                 "test_slurm.py",
                 "test_train_reference_queue.py", "test_s3_batches.py", "test_pipeline.py",
                 "test_training_reference.py", "test_train_queue.py", "test_training_data.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within a file kept
