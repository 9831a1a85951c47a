"""Every worker visible (issue 42, item 2): a worker registers as soon as it starts, whatever its
server does, and `status` lists its GPU with its state, the reason and the URL it calls: one
whose URL answers 404 (not SGLang: the wrong --sglang-url) is `misconfigured`, one whose server
refuses connections is `waiting_for_server`, a healthy one is `serving`. Nothing is dispatched to
the two that cannot serve, and the job is done by the third."""
from __future__ import annotations

import http.server
import threading

from conftest import write_jsonl
from support import free_port, python, wait_until


class NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_error(404)

    def log_message(self, *args):
        pass


def test_status_shows_a_misconfigured_a_waiting_and_a_serving_worker(cluster, tmp_path):
    c = cluster()
    c.start_server(0)
    c.start_worker(0)
    c.start_beat()
    wrong = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), NotFound)
    threading.Thread(target=wrong.serve_forever, daemon=True).start()
    refused = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    try:
        for gpu, url in ((1, f"http://127.0.0.1:{wrong.server_port}"), (2, refused)):
            c.spawn(f"worker{gpu}", python("manage.py", "worker", "--gpu", str(gpu), "--node",
                                           c.node, "--sglang-url", url))
        data = write_jsonl(tmp_path / "d.jsonl",
                           [{"id": f"w{i}", "prompt": f"Say {i}."} for i in range(30)])
        c.manage("enqueue", "--dataset", str(data), "--job", "seen")

        def three() -> dict | None:
            gpus = c.status("seen")["gpus"]
            states = {g: v["state"] for g, v in gpus.items()}
            return gpus if states == {"gpu0@local": "serving", "gpu1@local": "misconfigured",
                                      "gpu2@local": "waiting_for_server"} else None

        gpus = wait_until(three, timeout=60, interval=0.5, what="three GPUs with their states")
        assert "answered HTTP 404" in gpus["gpu1@local"]["state_reason"]
        assert f"127.0.0.1:{wrong.server_port}" in gpus["gpu1@local"]["url"]
        assert "ConnectError" in gpus["gpu2@local"]["state_reason"]
        assert gpus["gpu2@local"]["url"] == refused
        assert all(v["alive"] for v in gpus.values())
        table = c.manage("status", "--job", "seen").stdout
        assert "misconfigured" in table and "waiting_for_server" in table
        done = c.wait_done("seen", timeout=120)
        assert done["gpus"]["gpu0@local"]["completed"] == 30
        assert done["gpus"]["gpu1@local"]["completed"] == 0 == done["gpus"]["gpu2@local"]["completed"]
    finally:
        wrong.shutdown()
