"""S3 for development and the benchmarks: moto's S3 server as a subprocess (a real HTTP endpoint,
as boto3 sees S3 or MinIO), and a TCP proxy in front of it that can be cut and restored (S3
unreachable while moto keeps its objects)."""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import boto3
import httpx

from dflash_dev.local import Proc, free_port, python, wait_until

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
    endpoint refuses connections, as a down S3 or a cut network); start() listens again.
    `delay_s` holds every answer back that long (a slow endpoint)."""

    def __init__(self, upstream_port: int, port: int | None = None, delay_s: float = 0.0):
        self.delay_s = delay_s
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
            for a, b, delay in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pump, args=(a, b, delay), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, delay: bool) -> None:
        try:
            while data := src.recv(65536):
                if delay and self.delay_s:
                    time.sleep(self.delay_s)
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
