"""dflash_tasks.training.torch_dataset: the streaming torch dataset, split across DataLoader workers and ranks
with no sample missing or doubled, following a job while it still produces batches."""
from __future__ import annotations

import json

import torch
from conftest import write_jsonl
from support import ROOT, Proc, python, wait_until
from test_training_data import good_row, six_token_row, write_batches
from torch.utils.data import DataLoader

from dflash_tasks.core.keys import JobName
from dflash_tasks.output.batches import read_batch, read_manifest
from dflash_tasks.output.storage import LocalStorage
from dflash_tasks.training.data.gate import Rules
from dflash_tasks.training.torch_dataset import JobDataset, pad_collate


def test_two_ranks_of_two_workers_follow_a_running_job(cluster, tmp_path):
    c = cluster(batch_rows="10", batch_max_age_s="1")
    c.start_server(0, "--slots", "8", "--fixed-tokens", "150", "--decode-tps", "100")
    c.start_worker(0)
    c.start_beat()
    n = 160
    path = write_jsonl(tmp_path / "prompts.jsonl",
                       [{"id": f"d{i:03d}", "prompt": f"w{i} w{i + 1} w{i * 7}"} for i in range(n)])
    c.manage("enqueue", "--dataset", str(path), "--job", "stream", "--gpus", "1",
             "--max-output-tokens", "4096")
    outs = [tmp_path / f"rank{r}.jsonl" for r in (0, 1)]
    ranks = [Proc(python("tests/dataset_rank.py", "stream", str(c.output_dir), str(r), "2",
                         str(outs[r])), tmp_path / f"rank{r}.log",
                  env={**c.env, "PYTHONPATH": str(ROOT)}) for r in (0, 1)]

    def first_samples():
        for p in ranks:
            assert p.alive() or p.popen.returncode == 0, p.log()
        return all(o.exists() and o.stat().st_size for o in outs)

    try:
        wait_until(first_samples, timeout=120, interval=0.2, what="both ranks' first samples")
        early = c.status("stream")
        assert early["status"] == "running" and early["completed"] < n  # training before the end
        wait_until(lambda: not any(p.alive() for p in ranks), timeout=180, interval=0.5,
                   what="both ranks to finish with the job")
        for p in ranks:
            assert p.popen.returncode == 0, p.log()
    finally:
        for p in ranks:
            p.stop()
    assert c.status("stream")["status"] == "done"

    got = [[json.loads(line) for line in o.read_text().splitlines()] for o in outs]
    all_ids = [s["id"] for samples in got for s in samples]
    assert len(all_ids) == len(set(all_ids)) == n  # none missing, none doubled
    assert set(all_ids) == {f"d{i:03d}" for i in range(n)}

    # Each batch went to exactly the shard its position names: rank * 2 + worker.
    storage = LocalStorage(c.output_dir)
    records = sorted(read_manifest(storage, "stream")["batches"], key=lambda r: r["name"])
    assert len(records) >= 8  # every one of the 4 shards had batches to read
    want: dict[int, set] = {0: set(), 1: set()}
    rows = {}
    for position, rec in enumerate(records):
        for row in read_batch(storage, rec):
            want[(position % 4) // 2].add(row["id"])
            rows[row["id"]] = row
    for r in (0, 1):
        assert {s["id"] for s in got[r]} == want[r]
    for s in got[0] + got[1]:
        ids = rows[s["id"]]["token_ids"]
        assert s["len"] == len(ids["prompt"]) + len(ids["response"])
        assert s["loss"] == len(ids["response"]) and s["first_loss_at"] == len(ids["prompt"])


def test_snapshot_of_a_finished_job_with_rules_and_padding(tmp_path):
    rows = [six_token_row(i) if i % 4 == 0 else good_row(i) for i in range(120)]
    write_batches(tmp_path, "snap", rows, per_batch=10)
    (tmp_path / "snap" / "progress.json").write_text(json.dumps({"status": "done"}))
    good = {r["id"] for r in rows if r["id"].startswith("good")}

    seen = []
    for rank in (0, 1):
        ds = JobDataset("snap", tmp_path, rank=rank, world_size=2)
        loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=pad_collate)
        for batch in loader:
            assert batch["input_ids"].shape == batch["loss_mask"].shape == batch["attention_mask"].shape
            lengths = batch["attention_mask"].sum(1)
            for i, rid in enumerate(batch["id"]):
                assert batch["loss_mask"][i, lengths[i]:].sum() == 0  # padding is never trained on
                assert batch["input_ids"][i, lengths[i] - 1] == 151645  # ends with <|im_end|>
            seen.extend(batch["id"])
    assert sorted(seen) == sorted(good)  # six-token rows dropped by the default rules

    ds = JobDataset("snap", str(tmp_path), rules=Rules(min_loss_tokens=0), tensors=False)
    everything = list(ds)
    assert ds.stats["dropped:empty_answer"] == 30 and len(everything) == 90
    assert isinstance(everything[0]["input_ids"], list)
    assert torch.utils.data.get_worker_info() is None


def test_s3_through_the_manifest_validate_export_and_two_workers(tmp_path, monkeypatch):
    """The same, with the batches in S3 (moto over HTTP): each DataLoader worker makes its own
    client, validate and export read the manifest there."""
    from s3support import AWS_ENV, BUCKET, MotoServer
    from test_training_data import manage

    server = MotoServer(tmp_path / "moto.log")
    try:
        server.create_bucket()
        env = {**AWS_ENV, "AWS_ENDPOINT_URL": server.url}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        local = tmp_path / "local"
        rows = [good_row(i) for i in range(59)] + [six_token_row(0)]  # one bad row: 1.7%
        write_batches(local, "s3job", rows, per_batch=5)
        client = server.client()
        for path in sorted((local / "s3job").rglob("*")):
            if path.is_file():
                client.put_object(Bucket=BUCKET, Key=f"runs/{path.relative_to(local)}",
                                  Body=path.read_bytes())
        uri = f"s3://{BUCKET}/runs"

        ds = JobDataset("s3job", uri)
        ids = [s["id"] for s in DataLoader(ds, batch_size=None, num_workers=2)]
        assert sorted(ids) == sorted(r["id"] for r in rows[:59])  # the bad one dropped

        result = manage("validate", "--job", "s3job", "--from", uri, "--json", env=env)
        report = json.loads(result.stdout)
        assert result.returncode == 0 and report["rows"] == 60 and report["passed"], result.stderr
        out = manage("export", "--job", "s3job", "--from", uri, "--format", "specforge-tokenized",
                     "--to", str(tmp_path / "exp"), env=env)
        assert out.returncode == 0, out.stderr
        assert len((tmp_path / "exp" / "tokenized.jsonl").read_text().splitlines()) == 59
    finally:
        server.stop()


def test_following_a_slow_job_stops_on_request(tmp_path):
    """A training run cancelled while the job it follows ships nothing new stops at once,
    not after the job's next batch."""
    import time

    import pytest

    from dflash_tasks.training.torch_dataset import FollowStopped

    write_batches(tmp_path, "slow", [good_row(i) for i in range(3)])
    (tmp_path / "slow" / "progress.json").write_text(json.dumps({"status": "running"}))
    stop: list[bool] = []
    dataset = JobDataset("slow", tmp_path, follow=True, poll_s=60, tensors=False,
                         should_stop=lambda: bool(stop))
    samples = iter(dataset)
    assert [next(samples)["id"] for _ in range(3)] == ["good0000", "good0001", "good0002"]
    stop.append(True)
    started = time.monotonic()
    with pytest.raises(FollowStopped):
        next(samples)
    assert time.monotonic() - started < 30  # not the 60 s poll


def test_every_shard_keeps_the_newest_row_of_a_regenerated_prompt(redis_url, tmp_path):
    """Issue 27, item 7: a regenerated prompt has two rows, usually in batches of different
    shards. Before: each shard kept the first it met, so the old row was trained on (and the new
    one too, in another shard). Now beat lists the replaced rows in superseded.json, and the
    two ranks together yield every id once, the newest row of each."""
    import redis as redis_lib

    from dflash_tasks.core import jobs
    from dflash_tasks.ledger import Ledger
    from dflash_tasks.ledger.messages import encode_messages
    from dflash_tasks.output.batches import BatchPolicy, BatchWriter

    r = redis_lib.Redis.from_url(redis_url)
    book, job, n = Ledger(r), JobName("newest"), 60
    jobs.save(r, job, jobs.GenerationParams(), selection=jobs.GpuSelection(), dataset="x")
    book.add_prompts(job, [(f"good{i:04d}", encode_messages(good_row(i)["conversations"][:1]))
                           for i in range(n)])
    writer = BatchWriter(r, book, LocalStorage(tmp_path), BatchPolicy(rows=10, bytes=10**9,
                                                                      max_age_s=10**6))
    cut = set(range(0, n, 7))
    for i in range(n):
        row = good_row(i)
        if i in cut:
            row["metadata"]["finish_reason"] = "length"
        assert book.complete(job, row["id"], "gpu0@a", row)
    writer.flush(job, final=True)
    for ended in book.ended_rows(job, "length"):                  # regenerate --finish-reason length
        assert book.reopen(job, ended, ended.prompt, 0)
    assert writer.write_superseded(job)                           # nothing replaced yet
    for i in sorted(cut):
        new = good_row(i + 1000)
        new["id"] = f"good{i:04d}"
        assert book.complete(job, new["id"], "gpu0@a", new)
    writer.flush(job, final=True)
    assert writer.write_superseded(job)
    (tmp_path / job / "progress.json").write_text(json.dumps({"status": "done"}))

    rules = Rules(min_loss_tokens=0, keep_truncated=True)
    got = {}
    for rank in (0, 1):
        ds = JobDataset(job, tmp_path, rank=rank, world_size=2, rules=rules, tensors=False)
        for sample in ds:
            assert sample["id"] not in got, f"{sample['id']} yielded twice"
            got[sample["id"]] = sample
    assert set(got) == {f"good{i:04d}" for i in range(n)}
    newest = {row["id"]: row for rec in read_manifest(LocalStorage(tmp_path), job)["batches"]
              for row in read_batch(LocalStorage(tmp_path), rec)}   # the last one read wins
    for rid, sample in got.items():
        assert sample["input_ids"][-len(newest[rid]["token_ids"]["response"]):] == \
            newest[rid]["token_ids"]["response"], rid
    superseded = json.loads((tmp_path / job / "superseded.json").read_text())
    assert superseded["rows"] == len(cut)
