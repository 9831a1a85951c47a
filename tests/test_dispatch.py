"""Windowed dispatch (dflash_tasks/dispatch, dispatch/lua/take.lua) against the session's
redis-server: a top-up publishes Celery messages in the same call, and once pending is empty a
GPU with an empty queue takes a waiting prompt from another GPU's queue."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import redis

from dflash_tasks.core.keys import GpuName, JobName


@pytest.fixture
def dispatch(redis_url):
    """dispatch's functions on the test's Redis, with the deployed settings."""
    from dflash_tasks import dispatch as module
    from dflash_tasks.core.settings import Settings
    from dflash_tasks.ledger import Ledger
    from dflash_tasks.tasks.app import app

    book, s = Ledger(redis.Redis.from_url(redis_url)), Settings(redis_url=redis_url)
    return SimpleNamespace(
        topup=lambda job, gpu: module.topup(app, book, s, JobName(job), gpu),
        withdraw=lambda job, gpu, everything: module.withdraw(book, JobName(job), gpu,
                                                              everything=everything))


def g(index: int, node: str = "a") -> GpuName:
    """A GPU's name (its queue's too)."""
    return GpuName.on(node, index)


def setup_job(r: redis.Redis, name: str, n: int, gpus: int, concurrency: int) -> None:
    name = JobName(name)
    from dflash_tasks.core import jobs
    from dflash_tasks.ledger import Ledger
    from dflash_tasks.ledger.messages import encode_messages

    jobs.save(r, name, jobs.GenerationParams(), selection=jobs.GpuSelection.parse(str(gpus)),
              dataset="-", status="running")
    Ledger(r).add_prompts(name, [(f"p{i}", encode_messages([{"role": "user", "content": f"q{i}"}]))
                                 for i in range(n)])
    for gpu in range(gpus):
        r.hset("dflash:workers", g(gpu), json.dumps({"concurrency": concurrency}))


def queued(r: redis.Redis, queue: str) -> list[tuple[str, str, int]]:
    """The (job, id, GPU) args of the messages in a queue, in the order workers take them."""
    from kombu.transport.virtual.base import Channel

    out = []
    for raw in reversed(r.lrange(queue, 0, -1)):  # BRPOP takes from the tail
        payload = json.loads(raw)
        assert payload["headers"]["task"] == "dflash_tasks.generate"
        assert payload["headers"]["ignore_result"] is True  # no stored result (the task's own say)
        assert payload["properties"]["delivery_info"]["routing_key"] == queue
        body = Channel.decode_body(None, payload["body"], payload["properties"].get("body_encoding"))
        args, kwargs, embed = json.loads(body)
        assert kwargs == {} and set(embed) == {"callbacks", "errbacks", "chain", "chord"}
        out.append(tuple(args))
    return out


def test_topup_publishes_in_the_same_call(dispatch, redis_url):
    from dflash_tasks.core.keys import JobName

    r = redis.Redis.from_url(redis_url)
    setup_job(r, "w", n=10, gpus=2, concurrency=2)  # window: 2 x 1.5 = 3
    assert dispatch.topup("w", g(0)) == 3
    assert dispatch.topup("w", g(0)) == 0  # the window is full
    assert queued(r, g(0)) == [("w", "p0", g(0)), ("w", "p1", g(0)), ("w", "p2", g(0))]
    assert {m.decode() for m in r.zrange(JobName("w").inflight(g(0)), 0, -1)} == {"p0", "p1", "p2"}
    ids = [json.loads(m)["headers"]["id"] for m in r.lrange(g(0), 0, -1)]
    tags = [json.loads(m)["properties"]["delivery_tag"] for m in r.lrange(g(0), 0, -1)]
    assert len(set(ids)) == len(set(tags)) == 3
    # A finished prompt makes room for one more.
    r.zrem(JobName("w").inflight(g(0)), "p0")
    assert dispatch.topup("w", g(0)) == 1
    assert queued(r, g(0))[-1] == ("w", "p3", g(0))


def test_end_game_takes_the_newest_waiting_prompt_of_the_longest_other_queue(dispatch, redis_url):
    from dflash_tasks.core.keys import JobName

    r = redis.Redis.from_url(redis_url)
    k = JobName("e")
    setup_job(r, "e", n=6, gpus=2, concurrency=2)
    assert dispatch.topup("e", g(0)) == 3 and dispatch.topup("e", g(1)) == 3
    assert r.llen(k.pending) == 0
    # gpu1's worker took its three messages and finished one; its queue is empty.
    r.delete(g(1))
    r.zrem(k.inflight(g(1)), "p3")
    assert dispatch.topup("e", g(1)) == 1
    assert queued(r, g(1)) == [("e", "p2", g(1))]          # gpu0's newest waiting prompt
    assert queued(r, g(0)) == [("e", "p0", g(0)), ("e", "p1", g(0))]
    assert {m.decode() for m in r.zrange(k.inflight(g(0)), 0, -1)} == {"p0", "p1"}
    assert {m.decode() for m in r.zrange(k.inflight(g(1)), 0, -1)} == {"p4", "p5", "p2"}
    # With something in its own queue, a GPU takes nothing from the others.
    r.zrem(k.inflight(g(1)), "p4")
    assert dispatch.topup("e", g(1)) == 0
    # Another job's message, or one that is not a plain refill (a retry), is left where it is.
    r.delete(g(1))
    r.lpush(g(0), json.dumps({"body": json.dumps([["other", "x", 0], {}, {}]),
                                "headers": {"task": "dflash_tasks.generate"}, "properties": {}}))
    assert dispatch.topup("e", g(1)) == 0
    assert r.llen(g(0)) == 3


def test_a_gpu_the_job_no_longer_uses_takes_nothing(redis_url, dispatch):
    """After an enqueue with fewer GPUs (--gpus 1), the dropped GPU's worker still refills after each of
    the job's requests it finishes there: it must take nothing (it took prompts into an in-flight
    set status no longer counts; found by the chaos test, seed 312)."""
    from dflash_tasks.core import jobs

    r = redis.Redis.from_url(redis_url)
    setup_job(r, "fewer", 40, gpus=2, concurrency=4)
    assert dispatch.topup("fewer", g(1)) == 6
    jobs.save(r, JobName("fewer"), jobs.GenerationParams(), selection=jobs.GpuSelection.parse("1"),
              dataset="-", status="running")
    dispatch.withdraw(JobName("fewer"), g(1), everything=True)
    assert dispatch.topup("fewer", g(1)) == 0
    assert r.zcard("dflash:{fewer}:inflight:gpu1@a") == 0 and r.llen(g(1)) == 0
    assert dispatch.topup("fewer", g(0)) == 6


def test_a_node_that_joins_takes_work_and_nodes_select_gpus(redis_url, dispatch):
    """GPUs are named by node: gpu0 of two nodes are two GPUs with two queues. A job on every
    GPU (the default) gives work to a node's GPU the first time it asks (a node joining a running
    job); `--nodes` keeps only the named nodes' GPUs."""
    from dflash_tasks import dispatch as module
    from dflash_tasks.core import jobs
    from dflash_tasks.ledger import Ledger

    r = redis.Redis.from_url(redis_url)
    setup_job(r, "multi", 40, gpus=1, concurrency=2)
    jobs.save(r, JobName("multi"), jobs.GenerationParams(), selection=jobs.GpuSelection(),
              dataset="-", status="running")
    assert dispatch.topup("multi", g(0)) == 3
    for gpu in (g(0, "b"), g(1, "b")):                     # node b's workers register
        r.hset("dflash:workers", gpu, json.dumps({"concurrency": 2}))
    assert dispatch.topup("multi", g(0, "b")) == 3       # node b joins: its own queue, its own set
    assert [q[2] for q in queued(r, g(0, "b"))] == [g(0, "b")] * 3
    assert module.dispatched_gpus(r, JobName("multi")) == [g(0), g(0, "b")]
    assert module.dispatched_gpus(r, JobName("multi")) == module.job_gpus(r, jobs.load(r, JobName("multi")))[:2]
    # An outcome on one node takes a recalled prompt out of the other node's set (elsewhere.lua).
    prompt = queued(r, g(0, "b"))[0][1]
    row = {"id": prompt, "metadata": {"prompt_tokens": 1, "completion_tokens": 2,
                                       "finish_reason": "stop", "gpu": g(0)}}
    assert Ledger(r).complete(JobName("multi"), prompt, g(0), row)
    assert r.zscore(f"dflash:{{multi}}:inflight:{g(0, 'b')}", prompt) is None
    jobs.save(r, JobName("multi"), jobs.GenerationParams(), selection=jobs.GpuSelection.parse(None, "b"),
              dataset="-", status="running")
    r.delete(f"dflash:{{multi}}:inflight:{g(0)}", f"dflash:{{multi}}:inflight:{g(0, 'b')}")
    assert dispatch.topup("multi", g(0)) == 0             # node a is no longer selected
    assert dispatch.topup("multi", g(1, "b")) == 3


GPU_NAMES = [GpuName.on(n, i) for i in range(3) for n in ("a", "b", "node-c")]


@pytest.mark.parametrize("nodes", ["", "a", "b,node-c"])
@pytest.mark.parametrize("gpus", ["all", "1", "3", "gpu0@a", "gpu1@b,gpu2@node-c,gpu0@a"])
def test_take_lua_and_the_python_selection_agree(redis_url, gpus, nodes):
    """take.lua checks a job's GPU selection in Redis, GpuSelection.allows in Python (beat,
    enqueue, status): the two must say the same for every kind of selection and GPU."""
    from dflash_tasks.core import jobs
    from dflash_tasks.core.settings import Settings
    from dflash_tasks.dispatch import window
    from dflash_tasks.ledger import Ledger
    from dflash_tasks.ledger.messages import encode_messages

    r = redis.Redis.from_url(redis_url)
    selection = jobs.GpuSelection.parse(gpus, nodes)
    book = Ledger(r)
    for gpu in GPU_NAMES:
        jobs.delete(r, JobName("sel"))
        for name in GPU_NAMES:
            r.delete(name)
        jobs.save(r, JobName("sel"), jobs.GenerationParams(), selection=selection, dataset="-",
                  status="running")
        book.add_prompts(JobName("sel"), [("p", encode_messages([{"role": "user", "content": "q"}]))])
        took = window.take(r, Settings(), JobName("sel"), gpu, 1, task="dflash_tasks.generate",
                           origin="t", reply_to="")
        assert bool(took) == selection.allows(gpu), (selection, gpu)


def test_the_last_prompts_go_to_gpus_measurably_faster_while_they_are_alive(redis_url, dispatch):
    """The end game on unequal servers (issue 18) without rounds: complete.lua keeps each GPU's
    request speed; once the prompts left are fewer than the faster GPUs start in the time the
    slower one's slowness costs (window x (speed ratio - 1) each), the slower GPU takes none of
    them, unless those GPUs are gone (stale heartbeat) or their breaker is open; and once none
    is left, a faster GPU takes from a slower one's queue. In rounds (the deployed settings)
    what is left is a round at most, and the slower GPU keeps taking it."""
    from dflash_tasks import dispatch as module
    from dflash_tasks.core.keys import BREAKERS, WORKERS_SEEN, JobName
    from dflash_tasks.core.settings import Settings
    from dflash_tasks.ledger import Ledger
    from dflash_tasks.tasks.app import app

    r, book, k = redis.Redis.from_url(redis_url), Ledger(redis.Redis.from_url(redis_url)), JobName("end")
    rounds = dispatch
    # Rounds off (DFLASH_ENDGAME_ROUND_TOKENS=0): the rule this test is about.
    plain = Settings(redis_url=redis_url, endgame_round_tokens=0)
    dispatch = SimpleNamespace(topup=lambda job, gpu: module.topup(app, book, plain, JobName(job), gpu))
    setup_job(r, "end", 40, gpus=3, concurrency=4)  # windows of 6
    for gpu in range(3):
        assert dispatch.topup("end", g(gpu)) == 6
    for gpu, latency in ((0, 1.0), (1, 1.0), (2, 2.0)):     # gpu2 decodes at half the speed
        prompt = queued(r, g(gpu))[0][1]
        assert book.complete(JobName("end"), prompt, g(gpu), {"id": prompt, "metadata": {
            "prompt_tokens": 10, "completion_tokens": 1000, "finish_reason": "stop",
            "latency_s": latency}})
    assert {gpu.decode(): float(v) for gpu, v in r.hgetall(k.speed).items()} == \
        {g(0): 1000.0, g(1): 1000.0, g(2): 500.0}
    now = float(r.time()[0])
    r.hset(WORKERS_SEEN, mapping={g(0): now, g(1): now, g(2): now})
    # gpu0 and gpu1 start 4 x (1000 / 500 - 1) = 4 prompts each while gpu2's slowness costs.
    r.ltrim(k.pending, 0, 7)
    assert dispatch.topup("end", g(2)) == 0
    before = {m.decode() for m in r.zrange(k.inflight(g(2)), 0, -1)}
    assert len(before) < 6 and rounds.topup("end", g(2)) == 6 - len(before)  # in rounds: taken
    taken = {m.decode() for m in r.zrange(k.inflight(g(2)), 0, -1)} - before
    r.zrem(k.inflight(g(2)), *taken)                         # back as they were, for the rest
    r.rpush(k.pending, *sorted(taken))
    r.hset(BREAKERS, g(0), json.dumps({"state": "open"}))   # gpu0's server is failing: the
    r.ltrim(k.pending, 0, 3)                                 # 4 left are gpu1's alone
    assert dispatch.topup("end", g(2)) == 0
    r.ltrim(k.pending, 0, 4)
    r.rpush(k.pending, "p-extra")                            # 5: more than gpu1 takes in time
    assert dispatch.topup("end", g(2)) == 1
    r.hset(WORKERS_SEEN, g(1), now - 1000)                   # gpu1 gone too: gpu2 takes the rest
    assert dispatch.topup("end", g(2)) == 0                  # (its window is full again)
    r.zpopmin(k.inflight(g(2)), 3)
    assert dispatch.topup("end", g(2)) == 3
    # Pending empty: a faster GPU with room takes from a slower one's queue even while its own
    # queue still holds messages; not from a GPU as fast as itself.
    r.delete(k.pending, g(2), k.inflight(g(2)))
    r.rpush(k.pending, "late1", "late2")
    assert dispatch.topup("end", g(2)) == 2 and r.llen(k.pending) == 0
    assert r.llen(g(0)) > 0 and r.llen(g(1)) > 0
    r.zpopmin(k.inflight(g(1)), 1)
    assert dispatch.topup("end", g(1)) == 1 and [q[1] for q in queued(r, g(2))] == ["late1"]
    assert r.zscore(k.inflight(g(1)), "late2") is not None
    r.delete(g(2))
    r.zpopmin(k.inflight(g(1)), 1)
    assert dispatch.topup("end", g(1)) == 0     # gpu0's queue is not gpu1's to empty
    # A faster GPU's request speed moves as a moving average, not to each request's.
    prompt = queued(r, g(0))[1][1]                           # [0] is done already
    assert book.complete(JobName("end"), prompt, g(0), {"id": prompt, "metadata": {
        "prompt_tokens": 10, "completion_tokens": 1000, "finish_reason": "stop", "latency_s": 0.5}})
    assert float(r.hget(k.speed, g(0))) == pytest.approx(1050.0)


def test_a_small_job_is_spread_over_the_gpus_by_their_capacity(redis_url):
    """Issue 28: 50 prompts and two live GPUs went 48/2, because the first ready window took
    them all. Shared out by the windows (the workers' concurrency): 3 GPUs of concurrency 20,
    20 and 40 take 12, 13 and 25 of 50 (windows 30, 30 and 60); a job larger than the windows
    fills each one."""
    import time

    from dflash_tasks import dispatch as module
    from dflash_tasks.core import jobs
    from dflash_tasks.core.keys import WORKERS_SEEN, JobName
    from dflash_tasks.core.settings import Settings
    from dflash_tasks.ledger import Ledger
    from dflash_tasks.tasks.app import app

    r = redis.Redis.from_url(redis_url)
    book, s = Ledger(r), Settings(redis_url=redis_url)
    for name, n in (("small", 50), ("large", 500)):
        setup_job(r, name, n, gpus=3, concurrency=20)
        r.hset("dflash:workers", g(2), json.dumps({"concurrency": 40}))
        r.hset(WORKERS_SEEN, mapping={g(i): time.time() for i in range(3)})
        sent = module.topup_all(app, book, s, jobs.load(r, JobName(name)))
        taken = [r.zcard(JobName(name).inflight(g(i))) for i in range(3)]
        if name == "small":
            assert sent == 50 and sorted(taken) == [12, 13, 25], taken
        else:
            assert taken == [30, 30, 60], taken
    assert module.split(5, {"a": 1, "b": 10}) == {"a": 0, "b": 5}
    assert module.split(7, {"a": 2, "b": 2}) == {"a": 2, "b": 2}
