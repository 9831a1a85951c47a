"""The real-server checks (tests/sglang_checks.py) against the simulated server, in `make test`.

`make test-sglang` runs the same checks against the real SGLang 0.5.23 with a tiny model
(tests/sglang_real/); a behaviour where the two servers differ fails on one side only. The sim is
started the way the real one is: the same served name, context length 8,192 and a fixed natural
output length (the tiny model always says the same 23 tokens; the sim says 24 per prompt)."""
from __future__ import annotations

import pytest
import sglang_checks as checks

SIM_ARGS = ("--model-name", "tiny-qwen2", "--context-length", str(checks.CONTEXT_LENGTH),
            "--fixed-tokens", "24", "--slots", "8", "--decode-tps", "2000")


@pytest.fixture
def served_cluster(cluster):
    c = cluster(server_metrics_interval_s=0.5)
    port = c.start_server(0, *SIM_ARGS)
    c.start_worker(0)
    c.start_beat()
    return c, checks.Served(f"http://127.0.0.1:{port}", "tiny-qwen2", "sim")


def test_http_surface(cluster):
    c = cluster()
    port = c.start_server(0, *SIM_ARGS)
    checks.check_http_surface(checks.Served(f"http://127.0.0.1:{port}", "tiny-qwen2", "sim"))


def test_job_end_to_end(served_cluster, tmp_path):
    checks.check_job_end_to_end(*served_cluster, tmp_path)


def test_context_errors_are_permanent(served_cluster, tmp_path):
    checks.check_context_errors(*served_cluster, tmp_path)


def test_regenerate_continue(served_cluster, tmp_path):
    checks.check_regenerate_continue(*served_cluster, tmp_path)


def test_abort_and_continue(cluster):
    """Against a sim whose outputs last seconds (the tiny real model's do, asked to ignore its
    end token)."""
    c = cluster()
    port = c.start_server(0, "--model-name", "tiny-qwen2", "--fixed-tokens",
                          str(checks.ABORT_TOKENS), "--decode-tps", "1000")
    checks.check_abort_and_continue(checks.Served(f"http://127.0.0.1:{port}", "tiny-qwen2", "sim"))


def test_cut_at_every_offset(cluster):
    """Against a sim with a byte-level tokenizer, whose characters span several tokens as the
    tiny real model's do."""
    c = cluster()
    port = c.start_server(0, *SIM_ARGS, "--tokenizer", "bytes")
    checks.check_cut_at_every_offset(checks.Served(f"http://127.0.0.1:{port}", "tiny-qwen2", "sim"))
