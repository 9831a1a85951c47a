"""S3 for the tests: moto's S3 server and the proxy that cuts it (dflash_dev/s3.py), the cluster
settings that ship to it, and checks of a shipped dataset against its manifest."""
from __future__ import annotations

import json
from collections import Counter

from dflash_dev.s3 import AWS_ENV, BUCKET, MotoServer, TcpProxy  # noqa: F401  (the tests' names)
from dflash_tasks.core.keys import JobName


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
    job = JobName(job)
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
