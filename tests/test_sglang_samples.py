"""The simulated server answers in the shapes of a real SGLang 0.5.23 server: every field of the
responses captured from one (tests/sglang_samples/) is in the simulated server's answer to the
same kind of request, with the same JSON type wherever both have a value. The client parses
only some of these fields; a field the simulator drops would be found here before a parser
starts to rely on it."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from support import Proc, free_port, python, wait_until

SAMPLES = Path(__file__).parent / "sglang_samples"
CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16,
        "separate_reasoning": True, "stream": False}


def shape(value, path: str = "$") -> dict[str, str]:
    """path -> JSON type of every field; a list's items are described by its first one."""
    kind = type(value).__name__ if value is not None else "null"
    out = {path: kind}
    if isinstance(value, dict):
        for key, item in value.items():
            out.update(shape(item, f"{path}.{key}"))
    elif isinstance(value, list) and value:
        out.update(shape(value[0], f"{path}[]"))
    return out


def differences(sample: dict, answer: dict) -> list[str]:
    """The sample's fields the answer lacks, or has with another type (null matches anything:
    a captured null may be a value elsewhere, and the other way round)."""
    expected, got = shape(sample), shape(answer)
    found = []
    for path, kind in expected.items():
        if path not in got:
            found.append(f"{path}: missing (the real server sends {kind})")
        elif "null" not in (kind, got[path]) and {kind, got[path]} != {"int", "float"} \
                and kind != got[path]:
            found.append(f"{path}: {got[path]}, the real server sends {kind}")
    return found


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    port = free_port()
    server = Proc(python("-m", "dflash_dev.sim", "--port", str(port), "--decode-tps", "100000"),
                  tmp_path_factory.mktemp("samples") / "sim.log")
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(url + "/health").status_code == 200, timeout=30,
               what="the simulated server")
    yield url
    server.stop()


def post(url: str, path: str, body: dict) -> dict:
    answer = httpx.post(url + path, json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.mark.parametrize("sample, extra", [
    ("chat.json", {}),
    ("chat_8192.json", {"max_tokens": 8192}),
    ("chat_nothink.json", {"chat_template_kwargs": {"enable_thinking": False}}),
    ("chat_return_token_ids.json", {"return_token_ids": True}),  # what the client sends
])
def test_chat_completions_have_the_real_servers_fields(sim, sample, extra):
    answer = post(sim, "/v1/chat/completions", {**CHAT, **extra})
    assert not differences(json.loads((SAMPLES / sample).read_text()), answer)


@pytest.mark.parametrize("sample", ["generate.json", "generate_continue_from_ids.json"])
def test_native_generate_has_the_real_servers_fields(sim, sample):
    answer = post(sim, "/generate", {"input_ids": [151644, 872, 198, 9707, 13],
                                     "sampling_params": {"max_new_tokens": 8}, "stream": False})
    assert not differences(json.loads((SAMPLES / sample).read_text()), answer)


def test_a_context_overflow_is_the_real_servers_error(sim):
    answer = httpx.post(sim + "/v1/chat/completions", json={**CHAT, "max_tokens": 100_000},
                        timeout=30)
    body, status = (SAMPLES / "err_maxtok.txt").read_text().strip().rsplit(" [", 1)  # "... [400]"
    sample = json.loads(body)
    assert int(status.rstrip("]")) == sample["code"] == 400
    assert answer.status_code == 400, answer.text
    assert not differences(sample, answer.json())


def test_the_comparison_finds_a_missing_or_retyped_field():
    sample = {"a": {"b": 1, "c": [{"d": "x"}]}, "e": None}
    assert differences(sample, {"a": {"b": 2.5, "c": [{"d": "y", "z": 1}]}, "e": 3}) == []
    assert differences(sample, {"a": {"c": [{"d": 1}]}, "e": None}) == [
        "$.a.b: missing (the real server sends int)", "$.a.c[].d: int, the real server sends str"]


def captured(endpoint: str) -> dict:
    """misc.txt's answer to `endpoint`, cut to its top-level fields before `embedding` (the
    capture kept only the line's first 558 characters)."""
    lines = (SAMPLES / "misc.txt").read_text().splitlines()
    body = lines[lines.index(f"== {endpoint}") + 1]
    return json.loads(body[:body.index(',"embedding":')] + "}")


def test_model_info_and_server_info_carry_the_thinking_contract(sim):
    """The worker reads the reasoning parser and what selects the chat template from these
    (sglang.ServerContract); the real /model_info has reasoning_parser at its top level."""
    for path in ("/model_info", "/get_model_info"):
        sample = captured(path)
        assert "reasoning_parser" in sample
        assert not differences(sample, httpx.get(sim + path, timeout=10).json())
    info = httpx.get(sim + "/server_info", timeout=10).json()
    assert {"chat_template", "tokenizer_path", "revision", "reasoning_parser"} <= set(info)


def test_server_metrics_are_read_as_the_prometheus_text_format_says():
    """Issue 30: the captured SGLang 0.5.23 /metrics, and lines the hand-written parser misread:
    a sample with a timestamp (its value was taken for the timestamp), escaped label values, two
    ranks of one family (summed), a family the server does not serve (absent, not zero)."""
    from dflash_tasks.worker.server_metrics import FAMILIES, parse

    captured = parse((SAMPLES / "metrics.txt").read_text())
    assert set(captured) == set(FAMILIES.values())
    text = ('# TYPE sglang:num_running_reqs gauge\n'
            'sglang:num_running_reqs{model_name="qwen \\"3\\"",tp_rank="0"} 7 1764892800000\n'
            'sglang:num_running_reqs{model_name="qwen \\"3\\"",tp_rank="1"} 5 1764892800000\n'
            'sglang:num_queue_reqs{model_name="a,b=c"} 2.0\n')
    assert parse(text) == {"running": 12.0, "queued": 2.0}
