"""`make demo`: the whole job on one machine, on defaults.

Starts a redis-server of its own on a free port (never one it did not start), an S3 server
(moto, unless DFLASH_S3_URI names a bucket), two simulated SGLang servers with their pinned
workers, and beat; enqueues the bundled dataset, shows progress until done, lists the batches
uploaded to S3, downloads and verifies them with `manage.py export`, and stops what it started.
Run it again: the demo job starts over.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import httpx
import redis

from dflash_dev.local import LocalCluster, free_port, wait_until
from dflash_tasks.core import jobs
from dflash_tasks.core.keys import JobName
from dflash_tasks.core.settings import get_settings, redact_url
from dflash_tasks.output.batches import manifest_key, read_batch, read_manifest
from dflash_tasks.output.progress import progress_key
from dflash_tasks.output.storage import storage_for

ROOT = Path(__file__).resolve().parent.parent
DATASET = ROOT / "examples" / "prompts.jsonl"
JOB = "demo"
GPUS = 2
SIM_ARGS = ["--slots", "40", "--decode-tps", "1000"]
S3_BUCKET = "dflash-demo"


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


class Demo:
    def __init__(self, cluster: LocalCluster) -> None:
        self.settings = get_settings()
        self.cluster = cluster
        # Absolute: the children run in the repository's root, the demo wherever it was started.
        self.setenv(DFLASH_OUTPUT_DIR=str(self.settings.output_dir.resolve()))

    def setenv(self, **values: str) -> None:
        """For this process (settings, boto3) and for every child started from now on."""
        os.environ.update(values)
        self.cluster.env.update(values)
        get_settings.cache_clear()
        self.settings = get_settings()

    def redis(self) -> redis.Redis:
        """A redis-server of the demo's own, on a free port, every time: whatever answers at
        DFLASH_REDIS_URL may be a live deployment, whose workers would take the demo's GPU queues
        and write simulated rows into its jobs. Its data starts empty and is removed
        afterwards, with the server."""
        if not shutil.which("redis-server"):
            raise SystemExit("demo: redis-server is not on the PATH (Debian: apt-get install "
                             "redis-server); the demo starts its own and never uses another")
        data = Path(tempfile.mkdtemp(prefix="dflash-demo-redis-"))
        self.cluster.on_stop(lambda: shutil.rmtree(data, ignore_errors=True))
        ignored = os.environ.get("DFLASH_REDIS_URL")
        url = self.cluster.start_redis(free_port(), data)
        self.setenv(DFLASH_REDIS_URL=url)
        print(f"Redis: started the demo's own redis-server at {url} (stopped at the end)"
              + (f"; DFLASH_REDIS_URL={redact_url(ignored)} is not used" if ignored else ""))
        return redis.Redis.from_url(url)

    def servers(self) -> None:
        ports = [p if _port_free(p) else free_port()
                 for p in (self.settings.sglang_base_port + gpu for gpu in range(GPUS))]
        urls = self.cluster.start_servers(GPUS, SIM_ARGS, ports=ports)
        print(f"SGLang: {GPUS} simulated servers ({' '.join(SIM_ARGS)}) at {', '.join(urls)}")

    def workers(self) -> None:
        self.cluster.start_workers()
        self.cluster.start_beat()
        print(f"Celery: workers {self.cluster.gpu(0)}..{self.cluster.gpu(GPUS - 1)} and beat started "
              f"(logs in {self.cluster.logs})")

    def s3(self) -> None:
        """Batches go to S3: the bucket DFLASH_S3_URI names (credentials and endpoint from
        boto3's own chain), else a local S3 server (moto) started here, with dummy credentials.
        Batches of 64 rows (unless DFLASH_BATCH_ROWS says otherwise), so a few ship."""
        self.setenv(DFLASH_BATCH_ROWS=os.environ.get("DFLASH_BATCH_ROWS", "64"))
        if self.settings.s3_uri:
            print(f"S3: using {self.settings.s3_uri} (credentials and endpoint from boto3's chain)")
            return
        port = free_port()
        self.cluster.spawn("s3", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                  "-p", str(port)])
        endpoint = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(endpoint + "/moto-api/").status_code < 500, timeout=60,
                   what="the S3 server (moto)")
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            os.environ.pop(name, None)  # no real credentials or endpoint near the demo server
            self.cluster.env.pop(name, None)
        self.setenv(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="demo", AWS_SECRET_ACCESS_KEY="demo",
                    AWS_DEFAULT_REGION="us-east-1", DFLASH_S3_URI=f"s3://{S3_BUCKET}/runs")
        import boto3

        boto3.session.Session().client("s3").create_bucket(Bucket=S3_BUCKET)
        print(f"S3: started a local S3 server (moto) at {endpoint}, batches go to "
              f"{self.settings.s3_uri}")

    def forget_previous_run(self) -> None:
        shutil.rmtree(self.settings.output_dir / JOB, ignore_errors=True)
        shutil.rmtree(self.settings.output_dir / f"{JOB}-export", ignore_errors=True)

    def run(self) -> None:
        r = self.redis()
        self.forget_previous_run()
        self.s3()
        self.servers()
        self.workers()
        print()
        self.cluster.manage("enqueue", "--dataset", str(DATASET), "--job", JOB, "--gpus", str(GPUS),
                            "--max-output-tokens", "8192", "--follow")
        wait_until(lambda: jobs.load(r, JobName(JOB)).status == "done", timeout=120, what="the final batch")
        self.report()

    def report(self) -> None:
        out = self.settings.output_dir / JOB
        storage = storage_for(self.settings)
        manifest = read_manifest(storage, JOB)
        row = read_batch(storage, manifest["batches"][0])[0]
        answer = row["conversations"][-1]
        print(f"\nOutput: {len(manifest['batches'])} batches, {manifest['rows']} rows, "
              f"{manifest['bytes']:,} bytes, uploaded to {storage.location(JOB)}/")
        for record in manifest["batches"]:
            print(f"  {storage.location(record['key'])}  rows={record['rows']}  "
                  f"bytes={record['bytes']:,}  sha256={record['sha256'][:12]}…")
        print(f"  manifest: {storage.location(manifest_key(JOB))}")
        print(f"  progress: {out / 'progress.json'}, and {storage.location(progress_key(JOB))}")
        dest = self.settings.output_dir / f"{JOB}-export"
        print(f"\n$ python manage.py export --job {JOB} --to {dest}")
        self.cluster.manage("export", "--job", JOB, "--to", str(dest))
        print("\nA row (abridged):")
        print(json.dumps({**row, "conversations": [*row["conversations"][:-1], {
            **answer, "content": answer["content"][:60] + "…",
            "reasoning_content": (answer["reasoning_content"] or "")[:60] + "…"}],
            "token_ids": {k: f"[{len(v)} ids]" for k, v in row.get("token_ids", {}).items()}}, indent=1))


def main() -> None:
    with LocalCluster(get_settings().output_dir / "demo-logs") as cluster:
        Demo(cluster).run()


if __name__ == "__main__":
    main()
