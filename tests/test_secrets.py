"""A deployment as docs/SECURITY.md exposes it: Redis over TLS (`rediss://`, the CA checked) with a
password, S3 keys, Flower's credentials. A job and a training run go through it, then every log,
every file it wrote, every Redis value and Flower's view of the tasks and workers are searched
for the secrets: none may appear. The trainer prints its whole environment into its log (which
goes to Redis too), as a careless one would."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import redis
from conftest import Cluster, write_jsonl
from s3support import AWS_ENV, BUCKET
from support import Proc, free_port, python, wait_until
from test_train_queue import GATE, SIM_ARGS, queue_run, wait_run, write_text

REDIS_PASSWORD = "redis-pw-7f3a9c-never-logged"
AWS_SECRET = "aws-secret-5d1e88-never-logged"
FLOWER_PASSWORD = "flower-pw-b41c07-never-logged"
SECRETS = (REDIS_PASSWORD, AWS_SECRET, FLOWER_PASSWORD)


def make_certs(d: Path) -> None:
    """A CA and a certificate for 127.0.0.1 it signed, as docs/SECURITY.md makes them."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
            "-keyout", "ca.key", "-out", "ca.crt")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", "redis.key", "-out", "redis.csr")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "redis.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "redis.crt")


def every_value(r: redis.Redis) -> bytes:
    """Every key and every value in the database, whatever its type."""
    out = []
    for key in r.scan_iter(count=1000):
        kind = r.type(key).decode()
        value = {"string": lambda: [r.get(key)],
                 "hash": lambda: [x for kv in r.hgetall(key).items() for x in kv],
                 "list": lambda: r.lrange(key, 0, -1),
                 "set": lambda: list(r.smembers(key)),
                 "zset": lambda: r.zrange(key, 0, -1),
                 "stream": lambda: [json.dumps({k.decode(): v.decode(errors="replace")
                                                for k, v in fields.items()}).encode()
                                    for _, fields in r.xrange(key)]}[kind]()
        out += [key, *(v or b"" for v in value)]
    return b"\n".join(out)


@pytest.mark.skipif(not shutil.which("openssl"), reason="needs openssl to make certificates")
def test_no_secret_in_logs_files_redis_or_flower(tmp_path, moto):
    certs = tmp_path / "certs"
    certs.mkdir()
    make_certs(certs)
    port = free_port()
    (tmp_path / "redis").mkdir()
    server = Proc(["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                   "--tls-cert-file", str(certs / "redis.crt"),
                   "--tls-key-file", str(certs / "redis.key"),
                   "--tls-ca-cert-file", str(certs / "ca.crt"), "--tls-auth-clients", "no",
                   "--requirepass", REDIS_PASSWORD, "--appendonly", "yes", "--save", "",
                   "--dir", str(tmp_path / "redis")], tmp_path / "logs" / "00-redis.log")
    url = (f"rediss://:{REDIS_PASSWORD}@127.0.0.1:{port}/0"
           f"?ssl_cert_reqs=required&ssl_ca_certs={certs / 'ca.crt'}")
    wait_until(lambda: redis.Redis.from_url(url).ping(), timeout=20, what="redis-server over TLS")
    with pytest.raises(redis.ConnectionError):  # plain text is not served
        redis.Redis(port=port, password=REDIS_PASSWORD, socket_timeout=2).ping()

    templates = write_text(tmp_path / "node.toml", '[templates]\nprint-env = "env"\n')
    c = Cluster(tmp_path, url, s3_uri=f"s3://{BUCKET}/runs", train_templates=str(templates),
                batch_rows="10", flower_basic_auth=f"operator:{FLOWER_PASSWORD}")
    c.env.update({**AWS_ENV, "AWS_SECRET_ACCESS_KEY": AWS_SECRET, "AWS_ENDPOINT_URL": moto.url})
    moto_client = moto.client()
    try:
        c.start_server(0, *SIM_ARGS)
        c.start_worker(0)
        c.start_beat()
        c.start_train_worker()
        flower_port = free_port()
        base = f"http://127.0.0.1:{flower_port}"
        c.spawn("flower", python("manage.py", "flower", "--port", str(flower_port)))
        wait_until(lambda: httpx.get(base + "/healthcheck").status_code == 200, timeout=60,
                   what="Flower to answer")

        rows = [{"id": f"s{i}", "prompt": f"w{i} w{i * 3}"} for i in range(20)]
        c.manage("enqueue", "--dataset", str(write_jsonl(tmp_path / "p.jsonl", rows)),
                 "--job", "sec", "--gpus", "1")
        c.wait_done("sec", timeout=120)
        run = queue_run(c, "--job", "sec", "--trainer", "command", "--template", "print-env",
                        "--config", str(write_text(tmp_path / "train.toml", GATE)))
        done = wait_run(c, run, ("done", "failed", "refused"))
        assert done["status"] == "done", done
        log = Path(done["log_path"]).read_text()
        assert "AWS_ENDPOINT_URL=" in log  # it did print its environment

        auth = ("operator", FLOWER_PASSWORD)
        flower = wait_until(lambda: (t := httpx.get(base + "/api/tasks", auth=auth, timeout=30).text)
                            and "dflash_tasks.train" in t and t, timeout=60,
                            what="Flower to see the training task")
        flower += httpx.get(base + "/api/workers?refresh=1", auth=auth, timeout=30).text
        assert "gpu0@" in flower
        in_redis = every_value(c.r)
        assert b"dflash:train:run:" in in_redis and b"celery-task-meta-" in in_redis
        shipped = b"".join(moto_client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()
                           for o in moto_client.list_objects_v2(Bucket=BUCKET)["Contents"])
    finally:
        c.stop()
        server.stop()

    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "progress.json" for p in files) and any(p.name == "train.log" for p in files)
    assert len(list(c.logs.glob("*.log"))) >= 6  # redis, sim, worker, beat, training worker, flower
    for secret in SECRETS:
        leaked = [str(p.relative_to(tmp_path)) for p in files if secret.encode() in p.read_bytes()]
        assert not leaked, f"{secret} in {leaked}"
        assert secret.encode() not in in_redis, f"{secret} in a Redis value"
        assert secret not in flower, f"{secret} in Flower's tasks or workers"
        assert secret.encode() not in shipped, f"{secret} in what was shipped to S3"
