"""A worker's HTTP connections to its SGLang server follow its concurrency: a worker of 320
threads (a 256-slot server plus its margin) has 320 requests in flight, not 256 and 64 threads
waiting for a connection while their decode slots stay idle."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import redis

from dflash_tasks.core.keys import GpuName
from dflash_tasks.core.settings import Settings
from dflash_tasks.worker import hooks
from dflash_tasks.worker.runtime import POOL_MARGIN, WorkerRuntime

THREADS = 320  # above httpx's and the client's former fixed cap of 256


class AllAtOnce(ThreadingHTTPServer):
    """Answers /health only once THREADS requests are open at the same time."""
    daemon_threads = True

    def __init__(self):
        self.barrier = threading.Barrier(THREADS, timeout=20)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(handler):  # noqa: N805 (the server's own state is self)
                try:
                    self.barrier.wait()
                    status = 200
                except threading.BrokenBarrierError:
                    status = 503
                handler.send_response(status)
                handler.send_header("Content-Length", "0")
                handler.end_headers()

            def log_message(handler, *args):  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.request_queue_size = THREADS


def test_the_pool_is_sized_from_the_workers_concurrency(monkeypatch):
    server = AllAtOnce()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    rt = WorkerRuntime(Settings(sglang_url=url), redis.Redis())  # Redis is never reached here
    monkeypatch.setattr(hooks, "runtime", lambda: rt)
    # Celery's celeryd_after_setup, as a worker started with -c 320 sends it.
    hooks._size_http_pools(sender="gpu0@a", instance=SimpleNamespace(concurrency=THREADS))
    assert rt.pool_size() == THREADS + POOL_MARGIN
    try:
        client = rt.client(GpuName("gpu0@a"))
        # Every thread in a request at once: only a pool of at least THREADS lets them all
        # reach the server, which answers none before the last arrives.
        with ThreadPoolExecutor(THREADS) as pool:
            answers = list(pool.map(lambda _: client.healthy(timeout_s=30), range(THREADS)))
        assert all(answers), f"{answers.count(False)} of {THREADS} requests never reached the server"
    finally:
        server.shutdown()
        server.server_close()
        client.close()
