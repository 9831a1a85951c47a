"""`make demo`: the whole job on one machine, on defaults.

Starts Redis if none answers, two simulated SGLang servers with their pinned workers, and beat;
enqueues the bundled dataset, shows progress until done, says where the output is, and stops
what it started. Run it again: the demo job starts over.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis

from . import jobs
from .batches import read_batch, read_manifest
from .keys import JobKeys
from .settings import get_settings, redact_url
from .storage import LocalStorage

ROOT = Path(__file__).resolve().parent.parent
DATASET = ROOT / "examples" / "prompts.jsonl"
JOB = "demo"
GPUS = 2
SIM_ARGS = ["--slots", "40", "--decode-tps", "1000"]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, check, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise SystemExit(f"demo: {what} did not come up within {timeout:.0f}s (see output/demo-logs/)")


class Demo:
    def __init__(self) -> None:
        self.settings = get_settings()
        self.logs = self.settings.output_dir / "demo-logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.children: list[subprocess.Popen] = []

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "wb")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.children.append(proc)
        return proc

    def redis(self) -> redis.Redis:
        url = self.settings.redis_url
        r = redis.Redis.from_url(url)
        try:
            r.ping()
            print(f"Redis: using {redact_url(url)}")
        except redis.exceptions.ConnectionError:
            host, port = r.connection_pool.connection_kwargs.get("host"), r.connection_pool.connection_kwargs.get("port", 6379)
            if host not in ("127.0.0.1", "localhost") or not shutil.which("redis-server"):
                raise SystemExit(f"demo: no Redis answers at {redact_url(url)}; start one or set DFLASH_REDIS_URL")
            data = self.settings.output_dir / "demo-redis"
            data.mkdir(parents=True, exist_ok=True)
            self.spawn("redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                                 "--dir", str(data), "--appendonly", "yes", "--save", ""])
            _wait("redis-server", r.ping)
            print(f"Redis: started redis-server on port {port} (append-only, in {data})")
        return r

    def servers(self) -> list[str]:
        urls = []
        for gpu in range(GPUS):
            port = self.settings.sglang_base_port + gpu
            if not _port_free(port):
                port = _free_port()
            self.spawn(f"sim{gpu}", [sys.executable, "manage.py", "sim-server", "--port", str(port), *SIM_ARGS])
            url = f"http://127.0.0.1:{port}"
            _wait(f"simulated server gpu{gpu}", lambda: httpx.get(url + "/health").status_code == 200)
            urls.append(url)
        print(f"SGLang: {GPUS} simulated servers ({' '.join(SIM_ARGS)}) at {', '.join(urls)}")
        return urls

    def workers(self, r: redis.Redis, urls: list[str]) -> None:
        r.hdel("dflash:workers", *[f"gpu{gpu}" for gpu in range(GPUS)])
        for gpu, url in enumerate(urls):
            self.spawn(f"worker{gpu}", [sys.executable, "manage.py", "worker", "--gpu", str(gpu), "--sglang-url", url])
        for gpu in range(GPUS):
            _wait(f"worker gpu{gpu}", lambda: r.hexists("dflash:workers", f"gpu{gpu}"))
        self.spawn("beat", [sys.executable, "manage.py", "beat"])
        print(f"Celery: workers gpu0..gpu{GPUS - 1} and beat started (logs in {self.logs})")

    def forget_previous_run(self, r: redis.Redis) -> None:
        keys = list(r.scan_iter(match=JobKeys(JOB)._k("*"), count=1000))
        if keys:
            r.delete(*keys)
        r.srem("dflash:jobs", JOB)
        shutil.rmtree(self.settings.output_dir / JOB, ignore_errors=True)

    def run(self) -> None:
        r = self.redis()
        self.forget_previous_run(r)
        self.workers(r, self.servers())
        print()
        subprocess.run([sys.executable, "manage.py", "enqueue", "--dataset", str(DATASET), "--job", JOB,
                        "--gpus", str(GPUS), "--max-output-tokens", "8192", "--follow"], cwd=ROOT, check=True)
        _wait("the final batch", lambda: jobs.load(r, JOB).status == "done", timeout=120)
        self.report()

    def report(self) -> None:
        out = self.settings.output_dir / JOB
        storage = LocalStorage(self.settings.output_dir)
        manifest = read_manifest(storage, JOB)
        row = read_batch(storage, manifest["batches"][0])[0]
        answer = row["conversations"][-1]
        print(f"\nOutput: {len(manifest['batches'])} batches, {manifest['rows']} rows, {manifest['bytes']:,} bytes")
        for record in manifest["batches"]:
            print(f"  {out / 'batches' / (record['name'] + '.jsonl.zst')}  rows={record['rows']}  sha256={record['sha256'][:12]}…")
        print(f"  manifest: {out / 'manifest.json'}\n  progress: {out / 'progress.json'}")
        print("\nA row (abridged):")
        print(json.dumps({**row, "conversations": [*row["conversations"][:-1], {
            **answer, "content": answer["content"][:60] + "…",
            "reasoning_content": (answer["reasoning_content"] or "")[:60] + "…"}],
            "token_ids": {k: f"[{len(v)} ids]" for k, v in row.get("token_ids", {}).items()}}, indent=1))

    def stop(self) -> None:
        for proc in reversed(self.children):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.children):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    demo = Demo()
    try:
        demo.run()
    finally:
        demo.stop()


if __name__ == "__main__":
    main()
