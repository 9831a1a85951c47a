"""Faults that are the deployment's, not the prompt's (issue 27): a URL that answers but is not
SGLang, a proxy that refuses, a server restarted with another model, a server dead behind a live
worker, two nodes with one name. None of them may fail a prompt in bulk: the GPU stops taking
work, says why in `status`, and its prompts go to the job's other GPUs; once fixed, the job
completes with nothing failed and no `retry-failed`.

The wrong server is a real HTTP server on loopback that is not SGLang (aiohttp, in a thread of
the test). Every test runs the deployed breaker and hand-over settings."""
from __future__ import annotations

import asyncio
import threading

import pytest
from aiohttp import web
from conftest import Cluster, write_jsonl
from failure_support import prompts
from support import free_port, python, wait_until

from dflash_tasks.core.settings import Settings


class NotSGLang:
    """Answers /health with 200 (as many servers do) and everything else with `status`: a
    wrong port, another product, a proxy that wants credentials."""

    def __init__(self, status: int):
        self.status, self.port, self.hits = status, free_port(), 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        async def health(_):
            return web.Response(text="ok")

        async def other(_):
            self.hits += 1
            return web.Response(status=self.status, text="Not Found" if self.status == 404
                                else "Forbidden")

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_route("*", "/{tail:.*}", other)
        asyncio.set_event_loop(self._loop)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


def _gpu(c: Cluster, job: str, gpu: int) -> dict:
    return c.status(job)["gpus"][c.gpu(gpu)]


@pytest.mark.parametrize("status, reason", [(404, "server_not_found"), (403, "unauthorized")])
def test_a_server_that_answers_but_is_wrong_fails_no_prompt(tmp_path, cluster, status, reason):
    """The only GPU's worker points at a URL that answers /health and 404 (or 403) elsewhere.
    Before: the whole backlog in the failed registry within seconds. Now: nothing fails, the
    GPU says it is misconfigured, and once its worker restarts against the right server the
    job completes with nothing failed and no retry-failed."""
    wrong = NotSGLang(status)
    try:
        c = cluster()
        c.servers[0] = (wrong.port, None)  # the worker's URL: the wrong server
        c.start_worker(0)
        c.start_beat()
        data = write_jsonl(tmp_path / "d.jsonl", prompts(50))
        c.manage("enqueue", "--dataset", str(data), "--job", "wrong")
        gpu = wait_until(lambda: (g := _gpu(c, "wrong", 0))["state"] == "misconfigured" and g,
                         timeout=60, what="the GPU shown misconfigured")
        assert reason in gpu["state_reason"], gpu
        snap = c.status("wrong")
        assert snap["failed"] == 0 and snap["completed"] == 0, snap
        assert "misconfigured" in c.manage("status", "--job", "wrong").stdout
        # The fix: the worker restarted against a real server.
        c.workers[0].stop()
        c.start_server(0)
        c.start_worker(0)
        snap = c.wait_done("wrong", timeout=240)
        assert snap["completed"] == 50 and snap["failed"] == 0
        assert snap["gpus"][c.gpu(0)]["state"] == "serving"
    finally:
        wrong.stop()


def test_a_server_restarted_with_another_model_hands_its_prompts_over(tmp_path, cluster):
    """GPU 1's server comes back serving another model: its requests answer 404 for the model
    the worker learnt. Not a prompt's failure: GPU 1 stops (model_changed), GPU 0 does all."""
    c = cluster()
    c.start_servers(2, [])
    c.start_workers()
    c.start_beat()
    port, proc = c.servers[1]
    proc.stop()
    c.servers[1] = (port, c.spawn("sim1b", python("-m", "dflash_dev.sim", "--port", str(port),
                                                  "--model-name", "Qwen/Qwen3-32B")))
    c._wait_healthy(1)
    data = write_jsonl(tmp_path / "d.jsonl", prompts(60))
    c.manage("enqueue", "--dataset", str(data), "--job", "model")
    snap = c.wait_done("model", timeout=240)
    assert snap["failed"] == 0 and snap["completed"] == 60
    gpu1 = snap["gpus"][c.gpu(1)]
    assert gpu1["state"] == "misconfigured" and "model_changed" in gpu1["state_reason"], gpu1
    assert gpu1["completed"] == 0


def test_a_dead_server_behind_a_live_worker_hands_its_prompts_over(tmp_path, cluster):
    """GPU 1's server dies for good while its worker lives (and keeps its heartbeat). Before:
    its prompts were re-queued on GPU 1 forever, the job stalled at 99.9%. Now its breaker opens
    and, after breaker_handover_s (the deployed 60 s), beat hands them to GPU 0."""
    assert Settings().breaker_handover_s == 60
    c = cluster()
    c.start_servers(2, [])
    c.start_workers()
    c.start_beat()
    c.servers[1][1].kill()
    data = write_jsonl(tmp_path / "d.jsonl", prompts(80))
    c.manage("enqueue", "--dataset", str(data), "--job", "dead")
    wait_until(lambda: _gpu(c, "dead", 1)["state"] == "transient", timeout=120,
               what="GPU 1's breaker open")
    snap = c.wait_done("dead", timeout=300)
    assert snap["completed"] == 80 and snap["failed"] == 0
    assert "its circuit breaker is open" in c.beat.log()


def test_a_second_worker_for_a_held_gpu_name_refuses_to_start(tmp_path, cluster):
    """Two nodes started with the same name (compose's default) would consume each other's
    queues. The second worker for gpu0@<node> refuses, naming the holder and itself; the first
    keeps its registration and its work."""
    c = cluster()
    c.start_server(0)
    first = c.start_worker(0)
    second = c.spawn("worker0-twin", python("manage.py", "worker", "--gpu", "0", "--node",
                                            c.node, "--sglang-url", c.url(0)))
    wait_until(lambda: not second.alive(), timeout=90, what="the second worker to exit")
    assert second.popen.returncode != 0
    log = second.log()
    assert "refuses to start" in log and f"pid {first.popen.pid}" in log, log[-2000:]
    assert first.alive()
    data = write_jsonl(tmp_path / "d.jsonl", prompts(20))
    c.manage("enqueue", "--dataset", str(data), "--job", "twin")
    c.start_beat()
    assert c.wait_done("twin", timeout=120)["completed"] == 20
