"""Bulk enqueue (dflash_tasks/ingest/loader.py, ledger/lua/add_prompts.lua, ledger/lua/unknown_ids.lua) and the
compact form of the stored messages, against the session's redis-server."""
from __future__ import annotations

import json

import redis

from dflash_tasks.core import jobs
from dflash_tasks.core.keys import JobName
from dflash_tasks.ingest.loader import PromptLoader
from dflash_tasks.ingest.prompts import Prompt
from dflash_tasks.ledger import Ledger
from dflash_tasks.ledger.messages import decode_messages, encode_messages, messages_json


def prompts(n: int, start: int = 0) -> list[Prompt]:
    return [Prompt(id=f"p{i}", messages=({"role": "user", "content": f"question {i} ✓ \"q\""},), line=i)
            for i in range(start, start + n)]


def test_messages_round_trip_compressed_and_plain():
    messages = ({"role": "system", "content": "be brief"}, {"role": "user", "content": "é 😀 \\ \" x" * 50})
    blob = encode_messages(messages)
    assert blob[:4] == b"\x28\xb5\x2f\xfd" and len(blob) < len(messages_json(messages).encode())
    assert decode_messages(blob) == list(messages)
    # Jobs stored as plain JSON before (or by another tool) still read.
    assert decode_messages(json.dumps(list(messages)).encode()) == list(messages)
    assert decode_messages(json.dumps(list(messages))) == list(messages)


def test_loader_stores_in_order_once_and_resumes_without_resending(redis_url):
    r = redis.Redis.from_url(redis_url)
    book = Ledger(r)
    k = JobName("load")
    jobs.save(r, JobName("load"), jobs.GenerationParams(), selection=jobs.GpuSelection(), dataset="d",
              status="loading")
    first = prompts(2500)
    loader = PromptLoader(r, book, JobName("load"), resume=False)
    assert loader.add_all(iter(first), chunk=700) == 2500
    assert [i.decode() for i in r.lrange(k.pending, 0, -1)] == [p.id for p in first]
    assert decode_messages(r.hget(k.prompts, "p7")) == list(first[7].messages)
    assert int(r.hget(k.counters, "total")) == 2500

    # 1,000 done (gone from prompts and pending, as complete.lua leaves them), then the dataset
    # again with 500 new prompts: only those are sent and added, in order, at the end.
    done = [p.id for p in first[:1000]]
    r.sadd(k.done, *done)
    r.hdel(k.prompts, *done)
    r.ltrim(k.pending, 1000, -1)
    again = PromptLoader(r, book, JobName("load"), resume=True)
    assert again.add_all(iter(first + prompts(500, start=2500)), chunk=700) == 500
    assert again.sent == 500
    assert r.llen(k.pending) == 2000
    assert r.lindex(k.pending, -1) == b"p2999"
    assert int(r.hget(k.counters, "total")) == 3000


def test_add_prompts_skips_done_duplicates_and_large_chunks(redis_url):
    r = redis.Redis.from_url(redis_url)
    book = Ledger(r)
    k = JobName("big")
    jobs.save(r, JobName("big"), jobs.GenerationParams(), selection=jobs.GpuSelection(), dataset="d")
    r.sadd(k.done, "p3")
    pairs = [(p.id, encode_messages(p.messages)) for p in prompts(9000)]
    pairs.append(("p5", b"[]"))  # a duplicate id within the call: the first one wins
    assert book.add_prompts(JobName("big"), pairs) == 8999
    assert r.llen(k.pending) == 8999 and not r.hexists(k.prompts, "p3")
    assert decode_messages(r.hget(k.prompts, "p5")) == list(prompts(1, start=5)[0].messages)


def test_add_prompts_refuses_a_job_deleted_while_it_loads(redis_url):
    """An enqueue reads its dataset for minutes; a `delete` meanwhile must not be undone by the
    chunks stored after it (keys of a job that no longer exists)."""
    import pytest


    r = redis.Redis.from_url(redis_url)
    jobs.save(r, JobName("gone"), jobs.GenerationParams(), selection=jobs.GpuSelection(), dataset="d",
              status="loading")
    loader = PromptLoader(r, Ledger(r), JobName("gone"), resume=False)
    loader.add(prompts(10))
    jobs.delete(r, JobName("gone"))
    loader.add(prompts(10, start=10))
    with pytest.raises(jobs.JobDeleted):
        loader.close()
    assert list(r.scan_iter(match="dflash:\\{gone\\}:*")) == []
