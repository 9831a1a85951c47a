"""Failures, end to end: transient faults retried until every prompt is done, a server that goes
away and comes back (the circuit breaker), permanent failures in the registry and
`retry-failed`, undecodable broker messages, and a warm shutdown in the middle of a run.
Real Redis, real workers, the simulated server's fault injection. (A Redis restart:
test_redis_restart.py; SIGKILL of a worker: test_pipeline.py.)"""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from failure_support import (
    check_books,
    counters,
    dataset,
    failed_registry,
    kombu_entry,
    messages_settled,
    pickled_task,
    prompts,
    sim_down,
    sim_hold,
    sim_release,
    sim_stats,
)
from support import ROOT, wait_until

from dflash_tasks.core.keys import JobName

FAST = ("--slots", "40", "--decode-tps", "8000")


# -- the pieces, in process ---------------------------------------------------------------------

def _client(handler):
    from dflash_tasks.sglang import SGLangClient

    client = SGLangClient("http://sglang.test", request_timeout_s=5)
    client._http = httpx.Client(base_url=client.base_url, transport=httpx.MockTransport(handler))
    return client


CHAT_OK = {"model": "m", "choices": [{"message": {"content": "a", "reasoning_content": "r"},
                                      "finish_reason": "stop"}],
           "usage": {"prompt_tokens": 3, "completion_tokens": 2}}


@pytest.mark.parametrize("answer, reason, transient", [
    ((400, {"object": "error", "message": "Requested token count exceeds the model's maximum "
                                          "context length of 8192 tokens."}), "invalid_request", False),
    # The deployment's, not the prompt's: the breaker opens at once, no prompt fails.
    ((404, {"object": "error", "message": "The model `x` does not exist."}), "server_not_found", False),
    ((404, "<html>Not Found</html>"), "server_not_found", False),
    ((401, "Unauthorized"), "unauthorized", False),
    ((403, "Forbidden"), "unauthorized", False),
    ((200, {"model": "m", "choices": [], "usage": {}}), "empty_response", False),
    ((408, "timeout"), "timeout", True),
    ((429, "slow down"), "unavailable", True),
    ((500, "boom"), "unavailable", True),
    ((502, "<html>bad gateway</html>"), "unavailable", True),
    ((503, {"object": "error", "message": "The request queue is full."}), "unavailable", True),
    ((504, "gateway timeout"), "unavailable", True),
    ((200, "<html>a proxy page</html>"), "bad_response", True),
    ((200, {"choices": [{"message": {}, "finish_reason": "abort"}], "usage": {}}), "aborted", True),
    (httpx.ConnectError("refused"), "unavailable", True),
    (httpx.RemoteProtocolError("Server disconnected without sending a response."), "unavailable", True),
    (httpx.ReadTimeout("timed out"), "timeout", True),
])
def test_every_failure_of_a_request_is_classified(answer, reason, transient):
    from dflash_tasks.sglang import SGLangError

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if isinstance(answer, Exception):
            raise answer
        status, body = answer
        return (httpx.Response(status, json=body) if isinstance(body, dict)
                else httpx.Response(status, text=body))

    with pytest.raises(SGLangError) as info:
        _client(handler).chat([{"role": "user", "content": "hi"}], max_tokens=16)
    assert (info.value.reason, info.value.transient) == (reason, transient)
    if reason in ("invalid_request", "server_not_found") and isinstance(answer[1], dict):
        assert answer[1]["message"] in str(info.value)  # the server's own words reach the registry


def test_a_404_after_the_server_changed_its_model_says_so():
    from dflash_tasks.sglang import ModelChanged

    served = {"id": "m"}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [served]})
        return httpx.Response(404, json={"object": "error", "message": "The model `m` does not exist."})

    client = _client(handler)
    client.served_model()
    served["id"] = "other"                # the server restarted with another model
    with pytest.raises(ModelChanged, match="'other' now, not 'm'"):
        client.chat([{"role": "user", "content": "hi"}], max_tokens=16)
    assert not client.identity_ok()


def test_breaker_trips_at_once_for_the_deployment_and_stops_on_one_repeated_failure():
    from dflash_tasks.worker.breaker import MISCONFIGURED, REPEATED_FAILURE, CircuitBreaker
    from dflash_tasks.worker.shutdown import Shutdown

    shutdown = Shutdown()
    identity = {"ok": False}
    b = CircuitBreaker("test", lambda: True, threshold=3, close_after=2, probe_base_s=0.01,
                       probe_cap_s=0.05, shutdown=shutdown)
    b.trip("server_not_found", "HTTP 404", lambda: identity["ok"])
    assert not b.closed and b.snapshot()["kind"] == MISCONFIGURED
    time.sleep(0.2)
    assert not b.closed                  # /health would say yes; the identity says no
    identity["ok"] = True
    wait_until(lambda: b.closed, timeout=5, what="closed once the identity reads right")
    # The safety net: the same permanent failure, threshold times in a row, that is not known
    # to be the prompt's. A success or another reason in between starts the count again.
    for reason in ("invalid_request", "invalid_request", "empty_response", "invalid_request"):
        b.record_permanent(reason, "HTTP 400: Bad Request")
    b.record_success()
    b.record_permanent(JobName("invalid_request"), "HTTP 400: Bad Request")
    b.record_permanent(JobName("invalid_request"), "HTTP 400: Bad Request")
    assert b.closed
    b.record_permanent(JobName("invalid_request"), "HTTP 400: Bad Request")
    assert not b.closed and b.snapshot()["kind"] == REPEATED_FAILURE
    assert "the last 3 requests all failed with invalid_request" in b.last_error
    time.sleep(0.2)
    assert not b.closed                  # until the worker restarts
    shutdown.begin(0)


def test_a_context_too_long_is_the_prompts_fault():
    from dflash_tasks.sglang import InvalidRequest

    sample = json.loads((ROOT / "tests/sglang_samples/err_maxtok.txt").read_text().rsplit(" [", 1)[0])
    assert InvalidRequest(sample["message"]).context_too_long
    assert not InvalidRequest("temperature must be a non-negative finite number").context_too_long


def test_a_good_answer_is_not_an_error():
    client = _client(lambda request: httpx.Response(200, json={"data": [{"id": "m"}]})
                     if request.url.path == "/v1/models" else httpx.Response(200, json=CHAT_OK))
    assert client.chat([{"role": "user", "content": "hi"}], max_tokens=16).content == "a"


def test_breaker_opens_on_consecutive_failures_and_closes_after_healthy_probes():
    from dflash_tasks.worker.breaker import CircuitBreaker
    from dflash_tasks.worker.shutdown import Shutdown

    health = {"ok": False, "probes": 0}

    def probe():
        health["probes"] += 1
        return health["ok"]

    shutdown = Shutdown()
    b = CircuitBreaker("test", probe, threshold=3, close_after=2, probe_base_s=0.01, probe_cap_s=0.05,
                       shutdown=shutdown)
    b.record_failure(JobName("reset"))
    b.record_failure(JobName("reset"))
    b.record_success()                   # not consecutive: stays closed
    b.record_failure(JobName("reset"))
    b.record_failure(JobName("reset"))
    assert b.closed and b.wait_closed(0)
    b.record_failure(JobName("refused"))
    assert not b.closed
    assert not b.wait_closed(0.2)        # open: a task waits, then is told not to send
    wait_until(lambda: health["probes"] >= 3, timeout=5, what="probes while unhealthy")
    health["ok"] = True
    assert b.wait_closed(5)              # two healthy probes in a row close it
    assert b.closed and b.times_opened == 1

    # Open again right after closing: it stays open longer (a flapping server).
    for _ in range(3):
        b.record_failure(JobName("503"))
    assert not b.closed and b._min_open_s > 0
    assert b.wait_closed(5)

    # A shutdown wakes every waiter at once.
    health["ok"] = False
    for _ in range(3):
        b.record_failure(JobName("503"))
    waited = []
    t = threading.Thread(target=lambda: waited.append(b.wait_closed(60)))
    t.start()
    shutdown.begin(0)
    t.join(5)
    assert waited == [False]


def test_backoff_is_full_jitter_under_an_exponential_cap(monkeypatch):
    from dflash_tasks.core.settings import get_settings
    from dflash_tasks.dispatch.retry import RetryPolicy

    s = get_settings()
    policy = RetryPolicy.from_settings(s)  # the deployed policy
    for retries in range(12):
        cap = min(s.retry_cap_s, s.retry_base_s * 2 ** retries)
        waits = [policy.backoff_s(retries) for _ in range(200)]
        assert all(0 <= w <= cap for w in waits)
        assert max(waits) > cap / 2  # spread over the whole range, not a fixed delay
    assert s.visibility_timeout_s > s.longest_unacked_s()  # the defaults are consistent


# -- the whole system ------------------------------------------------------------------------------

def test_transient_faults_and_garbage_messages_lose_nothing(cluster, tmp_path):
    """5% 503s, 2% reset connections, 1% hangs past the client timeout: every prompt completes,
    none fails, each id once. Entries in the GPU queue that are not valid task messages are logged
    and dropped, and the worker keeps working."""
    c = cluster(request_timeout_s=4, max_retries=20)
    c.start_server(0, *FAST, "--fail-503", "0.05", "--reset-rate", "0.02", "--hang-rate", "0.01",
                   "--seed", "7")
    worker = c.start_worker(0)
    c.start_beat()

    # Garbage in the queue before any work: not JSON, a pickled task, a body that is not JSON,
    # an envelope without kombu's properties. None may kill the worker or loop.
    for entry in ["this is not a kombu message",
                  pickled_task(c.gpu(0), ["j", "x", c.gpu(0)]),
                  kombu_entry(b"{not json", "application/json", c.gpu(0)),
                  json.dumps({"body": "e30=", "headers": {}})]:
        c.r.lpush(c.gpu(0), entry)
    wait_until(lambda: c.r.llen(c.gpu(0)) == 0, timeout=30, what="the worker to read the garbage")

    rows = prompts(500)
    c.manage("enqueue", "--dataset", str(dataset(tmp_path, rows)), "--job", "flaky",
             "--max-output-tokens", "2048")
    c.wait_done("flaky", timeout=240)
    out = check_books(c, "flaky", {r["id"] for r in rows})

    stats = sim_stats(c.url(0))["errors"]
    assert stats.get("fault_503", 0) > 0 and stats.get("reset", 0) > 0 and stats.get("hang", 0) > 0
    n = counters(c, "flaky")
    faults = stats["fault_503"] + stats["reset"] + stats["hang"]
    # Every fault was retried (a slow answer past the timeout on this busy machine may add some).
    assert faults <= n["retries"] <= faults + 25, (n, stats)
    assert n.get("retry:unavailable", 0) >= stats["fault_503"] and n.get("retry:timeout", 0) >= 1
    assert max(r["metadata"]["attempts"] for r in out) >= 2

    assert worker.alive()
    log = worker.log()
    assert log.count("dropped a queue entry that is not a kombu message") == 2
    assert "ContentDisallowed" in log  # the pickled task: refused, acknowledged, logged
    assert "Can't decode message body" in log
    assert "Unrecoverable error" not in log


def test_server_down_for_a_minute_costs_no_prompt_and_no_retry_storm(cluster, tmp_path):
    """The server goes away for 60 s mid-run. The worker's breaker opens after a few failures,
    its threads wait without sending, its queued prompts stay in the broker, and it resumes when
    /health answers again. With only 3 retries allowed, no prompt fails: time spent waiting on
    the breaker costs no attempt."""
    c = cluster(max_retries=3, breaker_threshold=5, breaker_probe_cap_s=3)
    c.start_server(0, "--slots", "40", "--decode-tps", "1500")
    c.start_worker(0)
    c.start_beat()
    rows = prompts(500)
    c.manage("enqueue", "--dataset", str(dataset(tmp_path, rows)), "--job", "outage",
             "--max-output-tokens", "2048")
    wait_until(lambda: c.status("outage")["completed"] >= 60, timeout=120, what="60 completions")

    before = counters(c, "outage")
    sim_down(c.url(0), 60)
    time.sleep(2)
    opened = wait_until(lambda: json.loads(c.r.hget("dflash:breakers", c.gpu(0)) or "{}")
                        .get("state") == "open", timeout=30, what="the breaker to open")
    assert opened
    # While it is down the worker holds no more than its threads' worth, the rest stays queued.
    wait_until(lambda: c.r.llen(c.gpu(0)) > 0, timeout=20, what="prompts queued in the broker")
    at_open = counters(c, "outage")
    time.sleep(20)
    during = counters(c, "outage")
    assert during.get("completed", 0) == at_open.get("completed", 0)
    assert during.get("retries", 0) == at_open.get("retries", 0)  # nothing sent while open
    wait_until(lambda: json.loads(c.r.hget("dflash:breakers", c.gpu(0)))["state"] == "closed",
               timeout=120, what="the breaker to close after the server is back")
    c.wait_done("outage", timeout=240)
    check_books(c, "outage", {r["id"] for r in rows})

    after = counters(c, "outage")
    concurrency = json.loads(c.r.hget("dflash:workers", c.gpu(0)))["concurrency"]
    outage_retries = after.get("retries", 0) - before.get("retries", 0)
    # The requests in flight when it went down fail once each; nothing more is sent while open.
    assert 0 < outage_retries <= concurrency + 10, outage_retries
    assert after.get("failed", 0) == 0


def test_permanent_failures_are_registered_at_once_and_retry_failed_is_idempotent(cluster, tmp_path):
    """Prompts too long for the context, and malformed ones, are in the failed registry after one
    attempt each, with the server's message. retry-failed re-queues them exactly once; after a
    change of max tokens the long ones succeed (counters move from failed to completed), the
    others fail again, once each, without a loop."""
    from dflash_tasks.core import jobs
    from dflash_tasks.ledger import Ledger

    c = cluster()
    port = c.start_server(0, *FAST, "--context-length", "8192")
    c.start_worker(0)
    c.start_beat()
    good = prompts(150)
    long_ok_later = [{"id": f"long{i}", "prompt": " ".join(f"word{j}" for j in range(5000))}
                     for i in range(3)]
    too_long = [{"id": "huge", "prompt": " ".join(f"w{j}" for j in range(9000))}]
    # Malformed prompts the dataset reader would refuse, stored as an older tool might have.
    malformed = {"empty": "[]", "shapeless": json.dumps(["just a string"])}
    jobs.save(c.r, JobName("perm"), jobs.GenerationParams(max_tokens=4096), selection=jobs.GpuSelection(),
              dataset="older tool")
    Ledger(c.r).add_prompts(JobName("perm"), list(malformed.items()))
    c.manage("enqueue", "--dataset", str(dataset(tmp_path, good + long_ok_later + too_long)),
             "--job", "perm", "--max-output-tokens", "4096")
    c.wait_done("perm", timeout=180)

    bad = {r["id"] for r in long_ok_later + too_long} | set(malformed)
    check_books(c, "perm", {r["id"] for r in good}, bad)
    registry = failed_registry(c, "perm")
    for pid, rec in registry.items():
        assert (rec["reason"], rec["class"], rec["attempts"], rec["status"]) == \
               ("invalid_request", "permanent", 1, 400), (pid, rec)
    assert "maximum context length of 8192" in registry["long0"]["error"]
    assert "The input (9" in registry["huge"]["error"]
    assert "Messages cannot be empty" in registry["empty"]["error"]
    assert "validation error" in registry["shapeless"]["error"]
    # One attempt each, no retry: a request per prompt, and one per round that went on (the
    # small job runs in the end game's rounds; the prompts too long for the cap went on after
    # their first round, and the server refused the whole cap).
    assert sim_stats(c.url(0))["requests"] == len(good) + len(bad) + counters(c, "perm")["rounds"]
    assert counters(c, "perm").get("retries", 0) == 0

    listing = json.loads(c.manage("failed", "--job", "perm", "--json").stdout)
    assert listing["failed"] == len(bad) and listing["by_class"] == {"permanent": len(bad)}
    assert set(listing["reasons"]) == {"invalid_request"}
    assert {p["id"] for p in listing["reasons"]["invalid_request"]["prompts"]} == bad
    text = c.manage("failed", "--job", "perm").stdout
    assert "invalid_request (permanent): 6 prompts" in text and "retry-failed --job perm" in text

    # Lower max tokens so the long prompts fit. The job stays done until retry-failed gives it
    # work again; the worker is stopped so nothing runs while retry-failed is checked for
    # idempotency (a done job cannot be paused).
    c.workers.pop(0).stop()
    c.manage("set", "--job", "perm", "--max-output-tokens", "2048")
    assert c.status("perm")["status"] == "done"
    assert "is done" in c.manage("pause", "--job", "perm", check=False).stderr
    # By default the prompts' own permanent failures stay: unchanged they would fail again.
    plain = c.manage("retry-failed", "--job", "perm").stdout
    assert "re-queued 0 prompts" in plain and "skipped 6 permanent failures" in plain \
        and "--include-permanent" in plain, plain
    assert failed_registry(c, "perm").keys() == bad
    force = ("--include-permanent", "--json")
    dry = json.loads(c.manage("retry-failed", "--job", "perm", "--dry-run", *force).stdout)
    assert dry["requeued"] == len(bad) and failed_registry(c, "perm").keys() == bad
    first = json.loads(c.manage("retry-failed", "--job", "perm", *force).stdout)
    second = json.loads(c.manage("retry-failed", "--job", "perm", *force).stdout)
    assert first["requeued"] == len(bad) and first["by_reason"] == {"invalid_request": len(bad)}
    assert second["requeued"] == 0
    assert first["status"] == "running"  # a done job with work again runs
    waiting = {m.decode() for m in c.r.lrange("dflash:{perm}:pending", 0, -1)} | \
        {m.decode() for m in c.r.zrange(f"dflash:{{perm}}:inflight:{c.gpu(0)}", 0, -1)}
    assert waiting == bad                            # each once, nothing else
    assert c.status("perm")["failed"] == 0 and failed_registry(c, "perm") == {}
    c.start_worker(0)
    c.wait_done("perm", timeout=120)
    ok = {r["id"] for r in good + long_ok_later}
    again = {"huge"} | set(malformed)
    check_books(c, "perm", ok, again)
    # once more each, no loop (and a request per round that went on)
    assert sim_stats(c.url(0))["requests"] == len(good) + 2 * len(bad) + counters(c, "perm")["rounds"]
    registry = failed_registry(c, "perm")
    failures = {k.decode(): int(v) for k, v in c.r.hgetall("dflash:{perm}:failures").items()}
    assert all(registry[pid]["attempts"] == 1 and failures[pid] == 2 for pid in again)
    assert counters(c, "perm")["requeued"] == len(bad)

    only_gpu0 = json.loads(c.manage("retry-failed", "--job", "perm", "--gpu", c.gpu(0), "--json").stdout)
    only_transient = json.loads(c.manage("retry-failed", "--job", "perm", "--reason", "transient",
                                         "--json").stdout)
    assert only_gpu0["requeued"] == only_transient["requeued"] == 0
    assert only_gpu0["skipped_permanent"] == {"invalid_request": len(again)}
    # A GPU or a reason that can match nothing is a typo: refused, with the choices.
    for option, value, says in (("--gpu", c.gpu(1), f"is not a GPU job perm ran on; its GPUs: {c.gpu(0)}"),
                                ("--gpu", "gpu0", "is not a GPU name"),
                                ("--reason", "timout", "is not a failure reason: one of")):
        refused = c.manage("retry-failed", "--job", "perm", option, value, check=False)
        assert refused.returncode == 2 and says in refused.stderr and "Traceback" not in refused.stderr, \
            refused.stderr
    assert port  # the server stayed up throughout


def test_warm_shutdown_returns_in_flight_prompts_at_once(cluster, tmp_path):
    """SIGTERM while generations run and retries wait for their ETA: requests past the grace
    period are aborted and their prompts put back in the queue, waiting retries go back too, so a
    new worker finishes the job without waiting for any visibility timeout (set to an hour here:
    a prompt lost in the stopped worker would hang the test)."""
    c = cluster(shutdown_grace_s=1, visibility_timeout_s=3600, reap_after_s=7200,
                lost_message_grace_s=3600, retry_base_s=4, retry_cap_s=8)
    c.start_server(0, "--slots", "40", "--decode-tps", "400", "--fail-503", "0.1", "--seed", "5")
    worker = c.start_worker(0)
    c.start_beat()
    rows = prompts(300)
    c.manage("enqueue", "--dataset", str(dataset(tmp_path, rows)), "--job", "term",
             "--max-output-tokens", "2048")
    wait_until(lambda: c.status("term")["completed"] >= 40, timeout=120, what="40 completions")
    assert sim_stats(c.url(0))["running"] > 0
    wait_until(lambda: counters(c, "term").get("retries", 0) > 0, timeout=30, what="a retry")
    started = time.monotonic()
    worker.stop(timeout=60)
    assert worker.popen.returncode == 0, worker.log()[-3000:]
    assert time.monotonic() - started < 30
    log = worker.log()
    assert "aborting" in log
    c.start_worker(0)
    c.wait_done("term", timeout=240)
    rows_out = check_books(c, "term", {r["id"] for r in rows})
    assert all(r["metadata"]["finish_reason"] != "abort" for r in rows_out)


def test_sigkill_while_retries_wait_loses_and_doubles_nothing(cluster, tmp_path):
    """SIGKILL of a worker holding running requests and retries waiting for their ETA: all of
    them are unacknowledged messages. The next worker on that queue puts them back at start (the
    visibility timeout, an hour here, would otherwise hold them); the ledger keeps one row each."""
    c = cluster(visibility_timeout_s=3600, reap_after_s=7200, lost_message_grace_s=3600,
                retry_base_s=1, retry_cap_s=4)
    c.start_server(0, "--slots", "40", "--decode-tps", "1500", "--fail-503", "0.1", "--seed", "3")
    worker = c.start_worker(0)
    c.start_beat()
    rows = prompts(400)
    # Held after 100 answers, however fast the machine, and killed once every message is queued
    # or unacknowledged (none in a BRPOP's reply, which only the reaper, an hour away here,
    # would bring back).
    sim_hold(c.url(0), after=100)
    c.manage("enqueue", "--dataset", str(dataset(tmp_path, rows)), "--job", "kill9",
             "--max-output-tokens", "2048")
    wait_until(lambda: sim_stats(c.url(0))["held"] > 0, timeout=120, what="answers held after 100")
    wait_until(lambda: messages_settled(c, "kill9", c.gpu(0)), timeout=60, what="messages settled")
    assert c.r.hlen("unacked") > 0
    worker.kill()
    assert (s := c.status("kill9"))["in_flight"] + s["retry_waiting"] > 0
    sim_release(c.url(0))
    again = c.start_worker(0)
    c.wait_done("kill9", timeout=240)
    assert "what a previous worker held) are back in the queue" in again.log()
    check_books(c, "kill9", {r["id"] for r in rows})
    assert counters(c, "kill9")["retries"] > 0
