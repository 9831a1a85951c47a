"""The seed's run, in small (issue 28): a job of which about a fifth was truncated at 4,096
tokens, its cap raised to 8,192, and `regenerate --continue`. Every truncated row's prefix (its
token ids and texts, ~50 KB with realistic ids) stays out of Redis: the row's entry goes to a
chunk object on the job's storage, and Redis holds a reference. Measured on realistic rows
(random token ids and words: nothing a compressor folds away), the Redis the job gains per row
taken back stays under 500 bytes, where it was about 49 KB; and every continued row, generated
by a real worker from the simulated server, begins with its own prefix."""
from __future__ import annotations

import random

import pytest
from conftest import write_jsonl  # noqa: F401  (the tests' shared helpers load with conftest)
from support import wait_until

from dflash_dev.sim import tokens
from dflash_dev.sim.server import split_reasoning
from dflash_tasks.core import jobs
from dflash_tasks.core.keys import JobName
from dflash_tasks.ledger import Ledger
from dflash_tasks.ledger.messages import encode_messages
from dflash_tasks.output.batches import BatchPolicy, BatchWriter
from dflash_tasks.output.storage import LocalStorage

GPU = "gpu0@local"
CUT = 4096
N = 400            # prompts; about a fifth truncated
WORDS = ["the", "proof", "follows", "since", "each", "term", "bounds", "an", "integral", "so",
         "consider", "we", "have", "therefore", "its", "limit", "is", "zero", "and", "thus"]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(n))


def job_rows(seed: int = 28) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(N):
        truncated = rng.random() < 0.2
        out = CUT if truncated else rng.randrange(200, 3000)
        prompt = [{"role": "user", "content": words(rng, 60)}]
        rows.append({
            "id": f"s{i:04d}",
            "conversations": [*prompt, {"role": "assistant",
                                        "content": "" if truncated else words(rng, out // 8),
                                        "reasoning_content": words(rng, out // 2)}],
            "status": "truncated" if truncated else "success",
            "metadata": {"finish_reason": "length" if truncated else "stop",
                         "prompt_tokens": 80, "completion_tokens": out, "reasoning_tokens": out,
                         "gpu": GPU, "enable_thinking": True, "latency_s": 9.0, "attempts": 1,
                         "completed_at": 1_700_000_000 + i},
            "token_ids": {"prompt": [rng.randrange(151_000) for _ in range(80)],
                          "response": [rng.randrange(151_000) for _ in range(out)]}})
    return rows


def job_bytes(r, job: str) -> int:
    """Every key of the job, as Redis itself counts its memory."""
    return sum(r.memory_usage(key, samples=0) or 0
               for key in r.scan_iter(match=JobName(job).every_key, count=1000))


@pytest.mark.timeout(400)
def test_continuing_truncated_rows_keeps_their_prefixes_out_of_redis(cluster, tmp_path):
    c = cluster()
    r, job = c.r, JobName("seed")
    rows = job_rows()
    truncated = {row["id"]: row for row in rows if row["metadata"]["finish_reason"] == "length"}
    assert 50 < len(truncated) < 120
    book = Ledger(r)
    jobs.save(r, job, jobs.GenerationParams(max_tokens=CUT), selection=jobs.GpuSelection(),
              dataset="seed.jsonl")
    book.add_prompts(job, [(row["id"], encode_messages(row["conversations"][:1])) for row in rows])
    writer = BatchWriter(r, book, LocalStorage(c.output_dir),
                         BatchPolicy(rows=100, bytes=10**9, max_age_s=10**6))
    for row in rows:
        assert book.complete(job, row["id"], GPU, row)
    writer.flush(job, final=True)
    assert r.xlen(JobName(job).output) == 0 and book.finish(job) == "done"

    c.manage("set", "--job", job, "--max-output-tokens", "8192")
    before = job_bytes(r, job)
    out = c.manage("regenerate", "--job", job, "--finish-reason", "length", "--continue").stdout
    assert f"{len(truncated)} continue from their truncated output: " \
           f"{len(truncated) * CUT:,} tokens reused" in out, out
    grown = job_bytes(r, job) - before
    assert grown <= 500 * len(truncated), f"{grown / len(truncated):.0f} bytes per row taken back"
    k = JobName(job)
    assert all(len(r.hget(k.prompts, pid)) < 32 for pid in truncated)  # references

    c.start_server(0, "--decode-tps", "200000", "--slots", "40")
    c.start_worker(0)
    c.start_beat()
    wait_until(lambda: c.status(job)["status"] == "done", timeout=240, what="the continuations")
    newest = {}
    for row in c.rows(job):
        newest[row["id"]] = row  # batches in time order: the last one is the newest
    for pid, old in truncated.items():
        new = newest[pid]
        prefix = old["token_ids"]["response"]
        assert new["token_ids"]["response"][:CUT] == prefix, pid
        assert new["token_ids"]["prompt"] == old["token_ids"]["prompt"], pid
        meta = new["metadata"]
        # Its prefix is what it kept; the shares (the prefix's, then those of the GPUs that went
        # on, in rounds or moved) add up to the whole output.
        assert meta["continued_tokens"] == CUT, pid
        assert sum(g["tokens"] for g in meta["gpus"]) == meta["completion_tokens"], pid
        assert meta["gpus"][0]["tokens"] == CUT, pid
        assert new["metadata"]["completion_tokens"] > CUT
        # Its text is the server's decoding of all its ids (the old row's made-up words are not
        # the text of its random ids: they are not kept).
        whole = tokens.decode(new["token_ids"]["response"], skip_special=True)
        turn = new["conversations"][-1]
        assert (turn["reasoning_content"], turn["content"]) == split_reasoning(whole, True), pid
