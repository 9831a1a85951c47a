"""Windowed dispatch (dflash_tasks/dispatch, ledger/take.lua) against the session's
redis-server: a top-up publishes Celery messages in the same call, and once pending is empty a
GPU with an empty queue takes a waiting prompt from another GPU's queue."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import redis


@pytest.fixture
def dispatch(redis_url):
    """dispatch's functions on the test's Redis, with the deployed settings."""
    from dflash_tasks import dispatch as module
    from dflash_tasks.core.settings import Settings
    from dflash_tasks.ledger import Ledger
    from dflash_tasks.tasks.app import app

    book, s = Ledger(redis.Redis.from_url(redis_url)), Settings(redis_url=redis_url)
    return SimpleNamespace(
        topup=lambda job, gpu: module.topup(app, book, s, job, gpu),
        withdraw=lambda job, gpu, everything: module.withdraw(book, job, gpu,
                                                              everything=everything))


def setup_job(r: redis.Redis, name: str, n: int, gpus: int, concurrency: int) -> None:
    from dflash_tasks.core import jobs
    from dflash_tasks.ledger import Ledger
    from dflash_tasks.ledger.messages import encode_messages

    jobs.save(r, name, jobs.GenerationParams(), gpus=gpus, dataset="-", status="running")
    Ledger(r).add_prompts(name, [(f"p{i}", encode_messages([{"role": "user", "content": f"q{i}"}]))
                                 for i in range(n)])
    for gpu in range(gpus):
        r.hset("dflash:workers", f"gpu{gpu}", json.dumps({"concurrency": concurrency}))


def queued(r: redis.Redis, queue: str) -> list[tuple[str, str, int]]:
    """The (job, id, gpu) args of the messages in a queue, in the order workers take them."""
    from kombu.transport.virtual.base import Channel

    out = []
    for raw in reversed(r.lrange(queue, 0, -1)):  # BRPOP takes from the tail
        payload = json.loads(raw)
        assert payload["headers"]["task"] == "dflash_tasks.generate"
        assert payload["properties"]["delivery_info"]["routing_key"] == queue
        body = Channel.decode_body(None, payload["body"], payload["properties"].get("body_encoding"))
        args, kwargs, embed = json.loads(body)
        assert kwargs == {} and set(embed) == {"callbacks", "errbacks", "chain", "chord"}
        out.append(tuple(args))
    return out


def test_topup_publishes_in_the_same_call(dispatch, redis_url):
    from dflash_tasks.core.keys import JobKeys

    r = redis.Redis.from_url(redis_url)
    setup_job(r, "w", n=10, gpus=2, concurrency=2)  # window: 2 x 1.5 = 3
    assert dispatch.topup("w", 0) == 3
    assert dispatch.topup("w", 0) == 0  # the window is full
    assert queued(r, "gpu0") == [("w", "p0", 0), ("w", "p1", 0), ("w", "p2", 0)]
    assert {m.decode() for m in r.zrange(JobKeys("w").inflight(0), 0, -1)} == {"p0", "p1", "p2"}
    ids = [json.loads(m)["headers"]["id"] for m in r.lrange("gpu0", 0, -1)]
    tags = [json.loads(m)["properties"]["delivery_tag"] for m in r.lrange("gpu0", 0, -1)]
    assert len(set(ids)) == len(set(tags)) == 3
    # A finished prompt makes room for one more.
    r.zrem(JobKeys("w").inflight(0), "p0")
    assert dispatch.topup("w", 0) == 1
    assert queued(r, "gpu0")[-1] == ("w", "p3", 0)


def test_end_game_takes_the_newest_waiting_prompt_of_the_longest_other_queue(dispatch, redis_url):
    from dflash_tasks.core.keys import JobKeys

    r = redis.Redis.from_url(redis_url)
    k = JobKeys("e")
    setup_job(r, "e", n=6, gpus=2, concurrency=2)
    assert dispatch.topup("e", 0) == 3 and dispatch.topup("e", 1) == 3
    assert r.llen(k.pending) == 0
    # gpu1's worker took its three messages and finished one; its queue is empty.
    r.delete("gpu1")
    r.zrem(k.inflight(1), "p3")
    assert dispatch.topup("e", 1) == 1
    assert queued(r, "gpu1") == [("e", "p2", 1)]          # gpu0's newest waiting prompt
    assert queued(r, "gpu0") == [("e", "p0", 0), ("e", "p1", 0)]
    assert {m.decode() for m in r.zrange(k.inflight(0), 0, -1)} == {"p0", "p1"}
    assert {m.decode() for m in r.zrange(k.inflight(1), 0, -1)} == {"p4", "p5", "p2"}
    # With something in its own queue, a GPU takes nothing from the others.
    r.zrem(k.inflight(1), "p4")
    assert dispatch.topup("e", 1) == 0
    # Another job's message, or one that is not a plain refill (a retry), is left where it is.
    r.delete("gpu1")
    r.lpush("gpu0", json.dumps({"body": json.dumps([["other", "x", 0], {}, {}]),
                                "headers": {"task": "dflash_tasks.generate"}, "properties": {}}))
    assert dispatch.topup("e", 1) == 0
    assert r.llen("gpu0") == 3


def test_a_gpu_the_job_no_longer_uses_takes_nothing(redis_url, dispatch):
    """After an enqueue with fewer --gpus, the dropped GPU's worker still refills after each of
    the job's requests it finishes there: it must take nothing (it took prompts into an in-flight
    set status no longer counts; found by the chaos test, seed 312)."""
    from dflash_tasks.core import jobs

    r = redis.Redis.from_url(redis_url)
    setup_job(r, "fewer", 40, gpus=2, concurrency=4)
    assert dispatch.topup("fewer", 1) == 6
    jobs.save(r, "fewer", jobs.GenerationParams(), gpus=1, dataset="-", status="running")
    dispatch.withdraw("fewer", 1, everything=True)
    assert dispatch.topup("fewer", 1) == 0
    assert r.zcard("dflash:{fewer}:inflight:1") == 0 and r.llen("gpu1") == 0
    assert dispatch.topup("fewer", 0) == 6
