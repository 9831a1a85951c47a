"""S3 for the tests: moto's S3 server as a subprocess (a real HTTP endpoint, as boto3 sees S3 or
MinIO), a TCP proxy in front of it that a test can cut and restore (S3 unreachable while moto
keeps its objects), and checks of a shipped dataset against its manifest."""
from __future__ import annotations

import json
import socket
import threading
from collections import Counter
from pathlib import Path

import boto3
import httpx
from support import Proc, free_port, python, wait_until

BUCKET = "dflash-test"
# The standard chain only: dummy credentials for moto, no profile or instance metadata lookups,
# and few retries, so a tick against a cut endpoint fails in seconds.
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing-secret-never-logged",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_MAX_ATTEMPTS": "2",
}


class MotoServer:
    def __init__(self, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = Proc(python("-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)),
                         log_path)
        wait_until(lambda: httpx.get(self.url + "/moto-api/").status_code < 500, timeout=60,
                   what=f"moto S3 server on port {self.port}")

    def client(self, endpoint: str | None = None):
        return boto3.session.Session(
            aws_access_key_id=AWS_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=AWS_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name=AWS_ENV["AWS_DEFAULT_REGION"]).client("s3", endpoint_url=endpoint or self.url)

    def create_bucket(self, bucket: str = BUCKET) -> str:
        self.client().create_bucket(Bucket=bucket)
        return bucket

    def stop(self) -> None:
        self.proc.stop()


class TcpProxy:
    """127.0.0.1:port -> upstream. stop() closes the listener and every open connection (the
    endpoint refuses connections, as a down S3 or a cut network); start() listens again."""

    def __init__(self, upstream_port: int, port: int | None = None):
        self.upstream = ("127.0.0.1", upstream_port)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> "TcpProxy":
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            with self._lock:
                self._conns -= {src, dst}

    def stop(self) -> None:
        if self._listener is not None:
            try:  # wakes the thread blocked in accept(), which otherwise keeps the port bound
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def s3_env(endpoint: str, prefix: str = "runs") -> tuple[dict, dict]:
    """(process environment, cluster settings) for a cluster shipping to moto at endpoint."""
    return {**AWS_ENV, "AWS_ENDPOINT_URL": endpoint}, {"s3_uri": f"s3://{BUCKET}/{prefix}"}


def s3_cluster(cluster, endpoint: str, **settings):
    """A cluster (conftest's `cluster` fixture) shipping to moto at endpoint, under runs/."""
    env, s3 = s3_env(endpoint)
    c = cluster(**s3, **settings)
    c.env.update(env)
    return c


def storage(endpoint: str, prefix: str = "runs"):
    """An S3Storage for the tests' own reads, with the same chain the cluster uses."""
    import os
    from unittest import mock

    from dflash_tasks.output.storage import S3Storage

    with mock.patch.dict(os.environ, {**AWS_ENV, "AWS_ENDPOINT_URL": endpoint}):
        st = S3Storage(f"s3://{BUCKET}/{prefix}")
        st.client  # created now, inside the patched environment
    return st


def shipped_rows(st, job: str) -> tuple[dict, list[dict]]:
    """The manifest and every row it lists, each batch checked against its sha256 and row
    count; and the manifest checked against the objects actually in the bucket."""
    from dflash_tasks.output.batches import read_batch, read_manifest

    manifest = read_manifest(st, job)
    listed = sorted(k for k in st.list(f"{job}/batches/"))
    assert listed == sorted(rec["key"] for rec in manifest["batches"]), \
        f"bucket and manifest differ: {sorted(set(listed) ^ {r['key'] for r in manifest['batches']})}"
    rows = [row for rec in manifest["batches"] for row in read_batch(st, rec)]
    assert manifest["rows"] == len(rows)
    assert manifest["bytes"] == sum(rec["bytes"] for rec in manifest["batches"])
    return manifest, rows


def assert_shipped_exactly_once(c, st, job: str, expected_ids: set[str]) -> tuple[dict, list[dict]]:
    manifest, rows = shipped_rows(st, job)
    ids = [row["id"] for row in rows]
    doubled = [i for i, n in Counter(ids).items() if n > 1]
    assert not doubled, f"ids in two rows: {doubled[:10]}"
    assert set(ids) == expected_ids, f"missing: {sorted(expected_ids - set(ids))[:10]}"
    snap = c.status(job)
    assert snap["completed"] == len(rows) == snap["total"]
    assert snap["batches"] == snap["s3_uploaded"] == len(manifest["batches"])
    assert snap["s3_bytes"] == manifest["bytes"]
    assert snap["total_output_tokens"] == sum(r["metadata"]["completion_tokens"] for r in rows)
    assert snap["unsealed_rows"] == 0 and snap["sealing_batch"] is None
    return manifest, rows


def progress_in_s3(st, job: str) -> dict:
    return json.loads(st.get(f"{job}/progress.json"))
