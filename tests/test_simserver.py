"""The simulated SGLang server, run as a real subprocess and spoken to over HTTP with httpx.

Expected shapes and messages are those captured from SGLang 0.5.23 (the samples the design notes
point to), copied here so that the tests run from a fresh clone.
"""
from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from support import Proc, free_port, python, wait_until

from dflash_dev.sim import lengths, tokens

MODEL = "Qwen/Qwen3-8B"

# Key order of the JSON SGLang 0.5.23 answers with (sglang-samples/*.json).
CHAT_KEYS = ["id", "object", "created", "model", "choices", "usage", "metadata"]
CHOICE_KEYS = ["index", "message", "logprobs", "finish_reason", "matched_stop"]
CHOICE_KEYS_WITH_IDS = CHOICE_KEYS + ["prompt_token_ids", "response_token_ids"]
MESSAGE_KEYS = ["role", "content", "reasoning_content"]
USAGE_KEYS = ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
              "reasoning_tokens", "completion_tokens_details"]
GENERATE_META_KEYS = [
    "id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions", "storage_prefetch_wait",
    "storage_staging_wait", "forward_entry_time", "prefill_finished_time", "queue_time", "reasoning_tokens",
    "completion_tokens", "cached_tokens", "weight_versions", "cached_tokens_details", "dp_rank", "e2e_latency",
    "request_received_ts", "first_token_latency", "api_server_dispatch_finish_ts", "request_finished_ts",
    "decode_throughput", "response_sent_to_client_ts"]
# sglang-samples/err_*.txt
ERR_EMPTY = {"object": "error", "message": "Messages cannot be empty.", "type": "BadRequestError",
             "param": None, "code": 400}
ERR_TEMP = {"object": "error", "message": "temperature must be a non-negative finite number, got -1.0.",
            "type": "BadRequestError", "param": None, "code": 400}
ERR_MAXTOK_SAMPLE = (
    "Requested token count exceeds the model's maximum context length of 2048 tokens. You requested a total "
    "of 100018 tokens: 18 tokens from the input messages and 100000 tokens for the completion. Please reduce "
    "the number of tokens in the input messages or the completion to fit within the limit.")
ERR_SCHEMA_START = ("1 validation error:\n  {'type': 'list_type', 'loc': ('body', 'messages'), "
                    "'msg': 'Input should be a valid list', 'input': 'notalist'}")


class Sim:
    """A simulated server in a subprocess, and a client for it."""

    def __init__(self, log_dir: Path, *args: str, wait: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = Proc(python("-m", "dflash_dev.sim", "--port", str(self.port), *args),
                         log_path=log_dir / f"sim-{self.port}.log")
        self.client = httpx.Client(base_url=self.url, timeout=30)
        if wait:
            self.wait_healthy()

    def wait_healthy(self, timeout: float = 20.0) -> None:
        wait_until(lambda: self.health() == 200, timeout=timeout, what=f"sim-server health\n{self.proc.log()}")

    def health(self) -> int:
        assert self.proc.alive(), self.proc.log()
        return httpx.get(f"{self.url}/health", timeout=2).status_code

    def chat(self, content: str, **fields) -> httpx.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}
        return self.client.post("/v1/chat/completions", json=body)

    def stats(self) -> dict:
        return self.client.get("/sim/stats").json()

    def stop(self) -> None:
        self.client.close()
        self.proc.stop()


@pytest.fixture(scope="module")
def fast(tmp_path_factory) -> Iterator[Sim]:
    """Default length model, but decoding is instantaneous."""
    sim = Sim(tmp_path_factory.mktemp("fast"), "--decode-tps", "1e7", "--prefill-tps", "1e9")
    yield sim
    sim.stop()


def plan(content: str, max_tokens: int | None = None, thinking: bool = True) -> lengths.ChatOutcome:
    return lengths.chat_plan([{"role": "user", "content": content}], max_tokens, enable_thinking=thinking)


def prompt_with_natural(lo: int, hi: int, thinking: bool = True) -> str:
    """A prompt whose natural output length lies in [lo, hi]."""
    for i in range(100_000):
        content = f"find a prompt {lo}-{hi} number {i}"
        if lo <= plan(content, thinking=thinking).natural_tokens <= hi:
            return content
    raise AssertionError("no such prompt")


def in_thread(fn, *args, **kwargs) -> dict:
    """Run fn in a thread; the returned dict gets "result" or "error" when it ends."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn(*args, **kwargs)
        except Exception as exc:  # the test inspects it
            box["error"] = exc

    box["thread"] = threading.Thread(target=target, daemon=True)
    box["thread"].start()
    return box


def check_chat_consistency(body: dict) -> None:
    """Everything the server reports about one choice agrees with its token ids and text."""
    choice, usage = body["choices"][0], body["usage"]
    message, ids = choice["message"], choice["response_token_ids"]
    assert usage["prompt_tokens"] == len(choice["prompt_token_ids"])
    assert usage["completion_tokens"] == len(ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    reasoning_words = (message["reasoning_content"] or "").split()
    answer_words = message["content"].split()
    # SGLang counts every token up to and including </think>, the markers too.
    thinking = message["reasoning_content"] is not None
    assert usage["reasoning_tokens"] == (min(len(ids), len(reasoning_words) + 2) if thinking else 0)
    details = usage["completion_tokens_details"]
    assert details == ({"reasoning_tokens": usage["reasoning_tokens"]} if usage["reasoning_tokens"] else None)
    words = [i for i in ids if i < tokens.VOCAB]
    assert words == [int(w[1:]) for w in reasoning_words + answer_words]
    finished = choice["finish_reason"] == "stop"
    assert (ids[-1] == tokens.IM_END) == finished
    assert choice["matched_stop"] == (tokens.IM_END if finished else None)
    if message["reasoning_content"] is not None:  # thinking: <think> reasoning </think> answer
        assert ids[0] == tokens.THINK
        if answer_words or finished:
            assert ids[len(reasoning_words) + 1] == tokens.END_THINK
    assert body["metadata"] == {"weight_version": "default",
                                "weight_versions": [{"version": "default", "start": 0, "end": len(ids)}]}


# ---------------------------------------------------------------------- the length model, no server


def test_length_distribution_matches_the_real_run():
    natural = [plan(f"pseudo prompt {i}: please explain topic {i * 7919}").natural_tokens for i in range(2000)]
    assert abs(statistics.median(natural) / 1800 - 1) < 0.05
    assert abs(sum(n > 4096 for n in natural) / len(natural) - 0.18) < 0.02
    assert min(natural) >= 4
    key = tokens.prompt_key(tokens.render_chat([{"role": "user", "content": "x"}]))
    assert lengths.natural_length(key) == lengths.natural_length(key, 1800.0, 0.18)
    assert lengths.natural_length(key, 300.0, 0.01) < lengths.natural_length(key, 3000.0, 0.4)


def test_makespan_helpers():
    outcome = plan("how long will this take", 4096)
    seconds = lengths.service_seconds(outcome.prompt_tokens, outcome.completion_tokens, decode_tps=100.0,
                                      prefill_tps=1e9)
    assert seconds == pytest.approx(outcome.completion_tokens / 100.0, rel=1e-3)
    assert lengths.ideal_makespan([4, 4, 4, 4], slots=2) == 8
    assert lengths.ideal_makespan([10, 1, 1], slots=3) == 10
    assert lengths.greedy_makespan([1, 1, 1, 3], slots=2) == 4


# ---------------------------------------------------------------------- chat completions


def test_chat_shape_and_ids_with_thinking(fast):
    content = prompt_with_natural(200, 3000)
    r = fast.chat(content, max_tokens=8192, return_token_ids=True, chat_template_kwargs={"enable_thinking": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert list(body) == CHAT_KEYS and body["object"] == "chat.completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert list(choice) == CHOICE_KEYS_WITH_IDS
    assert list(choice["message"]) == MESSAGE_KEYS and list(body["usage"]) == USAGE_KEYS
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["reasoning_content"] and choice["message"]["content"]
    check_chat_consistency(body)
    expected = plan(content, 8192)
    assert body["usage"]["completion_tokens"] == expected.completion_tokens == expected.natural_tokens
    assert body["usage"]["reasoning_tokens"] == expected.reasoning_tokens
    share = expected.reasoning_tokens / expected.completion_tokens
    assert 0.55 < share < 0.92
    assert choice["prompt_token_ids"] == tokens.render_chat([{"role": "user", "content": content}])
    assert choice["prompt_token_ids"][-2:] == [tokens.IM_START, tokens.ASSISTANT]


def test_chat_shape_without_thinking(fast):
    content = prompt_with_natural(50, 3000, thinking=False)
    r = fast.chat(content, max_tokens=8192, chat_template_kwargs={"enable_thinking": False})
    body = r.json()
    assert list(body) == CHAT_KEYS and list(body["choices"][0]) == CHOICE_KEYS
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"]
    assert body["usage"]["reasoning_tokens"] == 0 and body["usage"]["completion_tokens_details"] is None
    assert body["usage"]["completion_tokens"] == len(message["content"].split()) + 1  # + <|im_end|>
    r = fast.chat(content, max_tokens=8192, return_token_ids=True, chat_template_kwargs={"enable_thinking": False})
    check_chat_consistency(r.json())
    prompt_ids = r.json()["choices"][0]["prompt_token_ids"]
    assert prompt_ids[-4:] == [tokens.IM_START, tokens.ASSISTANT, tokens.THINK, tokens.END_THINK]


def test_finish_reason_length_below_the_natural_length_stop_at_it(fast):
    content = prompt_with_natural(100, 2000)
    natural = plan(content).natural_tokens
    at = fast.chat(content, max_tokens=natural, return_token_ids=True).json()
    below = fast.chat(content, max_completion_tokens=natural - 1, return_token_ids=True).json()
    assert at["choices"][0]["finish_reason"] == "stop" and at["usage"]["completion_tokens"] == natural
    assert below["choices"][0]["finish_reason"] == "length"
    assert below["usage"]["completion_tokens"] == natural - 1
    assert below["choices"][0]["response_token_ids"] == at["choices"][0]["response_token_ids"][:-1]
    small = fast.chat(content, max_tokens=10, return_token_ids=True).json()
    assert small["choices"][0]["finish_reason"] == "length" and small["usage"]["completion_tokens"] == 10
    assert small["choices"][0]["message"]["content"] == ""  # still reasoning
    assert small["usage"]["reasoning_tokens"] == 10  # <think> counts, as in SGLang
    for body in (at, below, small):
        check_chat_consistency(body)


def test_lengths_are_the_same_on_another_server(fast, tmp_path):
    other = Sim(tmp_path, "--decode-tps", "1e7", "--slots", "3")
    try:
        for i in range(5):
            content = f"determinism check {i}"
            a = fast.chat(content, max_tokens=8192, return_token_ids=True).json()
            b = other.chat(content, max_tokens=8192, return_token_ids=True).json()
            assert a["choices"][0]["response_token_ids"] == b["choices"][0]["response_token_ids"]
            assert a["choices"][0]["message"] == b["choices"][0]["message"]
            assert a["usage"]["completion_tokens"] == plan(content, 8192).completion_tokens
    finally:
        other.stop()


def test_error_bodies(fast):
    r = fast.client.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert (r.status_code, r.json()) == (400, ERR_EMPTY)
    r = fast.chat("hello", temperature=-1)
    assert (r.status_code, r.json()) == (400, ERR_TEMP)
    r = fast.client.post("/v1/chat/completions", json={"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})
    assert (r.status_code, r.json()) == (404, {"object": "error", "message": "The model `gpt-4` does not exist.",
                                               "type": "NotFoundError", "param": None, "code": 404})
    r = fast.client.post("/v1/chat/completions", json={"model": MODEL, "messages": "notalist"})
    assert r.status_code == 400 and r.json()["message"].startswith(ERR_SCHEMA_START)

    template = ("Requested token count exceeds the model's maximum context length of {} tokens. You requested a "
                "total of {} tokens: {} tokens from the input messages and {} tokens for the completion. Please "
                "reduce the number of tokens in the input messages or the completion to fit within the limit.")
    assert template.format(2048, 100018, 18, 100000) == ERR_MAXTOK_SAMPLE
    prompt_tokens = plan("too long").prompt_tokens
    r = fast.chat("too long", max_tokens=100000)
    assert r.status_code == 400
    assert r.json() == {"object": "error", "param": None, "code": 400, "type": "BadRequestError",
                        "message": template.format(40960, prompt_tokens + 100000, prompt_tokens, 100000)}
    assert fast.chat("x", top_p=0).json()["message"] == "top_p must be in (0, 1], got 0."
    r = fast.client.post("/generate", json={"text": "x", "sampling_params": {"temperature": -1}})
    assert (r.status_code, r.json()) == (400, {"error": {"message": ERR_TEMP["message"]}})
    assert fast.stats()["errors"]["bad_request"] >= 6


def test_info_endpoints(fast):
    models = fast.client.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0] | {"created": 0} == {"id": MODEL, "object": "model", "created": 0, "owned_by": "sglang",
                                                   "root": MODEL, "parent": None, "max_model_len": 40960}
    for path in ("/server_info", "/get_server_info"):
        info = fast.client.get(path).json()
        assert info["version"] == "0.5.23" and info["max_running_requests"] == 40
        assert info["context_length"] == 40960 and info["served_model_name"] == MODEL == info["model_path"]
    for path in ("/model_info", "/get_model_info"):
        assert fast.client.get(path).json()["served_model_name"] == MODEL
    loads = fast.client.get("/v1/loads").json()
    assert loads["version"] == "0.5.23" and loads["dp_rank_count"] == 1
    assert loads["loads"][0]["max_running_requests"] == 40
    assert {"total_running_reqs", "total_waiting_reqs", "avg_token_usage", "avg_throughput"} <= set(loads["aggregate"])
    metrics = fast.client.get("/metrics").text
    labels = f'{{engine_type="unified",model_name="{MODEL}",moe_ep_rank="0",pp_rank="0",tp_rank="0"}}'
    for name in ("num_running_reqs", "num_queue_reqs", "gen_throughput", "token_usage", "cache_hit_rate"):
        assert f"sglang:{name}{labels} " in metrics
    assert f'sglang:context_len{labels} 40960.0' in metrics
    for name in ("prompt_tokens_total", "generation_tokens_total", "num_requests_total",
                 "e2e_request_latency_seconds_count"):
        assert f'sglang:{name}{{engine_type="unified",is_streaming="false",model_name="{MODEL}"}} ' in metrics
    assert 'le="+Inf"' in metrics and "# TYPE sglang:e2e_request_latency_seconds histogram" in metrics


# ---------------------------------------------------------------------- /generate continuation


def test_generate_continues_exactly_like_one_long_generation(fast):
    content = prompt_with_natural(4200, 8000)
    first = fast.chat(content, max_tokens=4096, return_token_ids=True).json()["choices"][0]
    assert first["finish_reason"] == "length"
    input_ids = first["prompt_token_ids"] + first["response_token_ids"]
    r = fast.client.post("/generate", json={"input_ids": input_ids, "rid": "cont-1",
                                            "sampling_params": {"max_new_tokens": 4096, "temperature": 0.6}})
    assert r.status_code == 200, r.text
    cont = r.json()
    assert list(cont) == ["text", "output_ids", "meta_info"] and list(cont["meta_info"]) == GENERATE_META_KEYS
    meta = cont["meta_info"]
    assert meta["id"] == "cont-1" and meta["finish_reason"] == {"type": "stop", "matched": tokens.IM_END}
    assert meta["prompt_tokens"] == len(input_ids) and meta["cached_tokens"] == len(input_ids) - 1
    assert meta["cached_tokens_details"] == {"device": len(input_ids) - 1, "host": 0}
    assert meta["completion_tokens"] == len(cont["output_ids"])
    whole = fast.chat(content, max_tokens=8192, return_token_ids=True).json()["choices"][0]
    assert first["response_token_ids"] + cont["output_ids"] == whole["response_token_ids"]
    assert whole["finish_reason"] == "stop"

    # a capped continuation, and the same without thinking
    short = fast.client.post("/generate", json={"input_ids": input_ids, "sampling_params": {"max_new_tokens": 8}})
    assert short.json()["output_ids"] == cont["output_ids"][:8]
    assert short.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    content = prompt_with_natural(30, 500, thinking=False)
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True}
    head = fast.chat(content, max_tokens=10, **kwargs).json()["choices"][0]
    tail = fast.client.post("/generate", json={
        "input_ids": head["prompt_token_ids"] + head["response_token_ids"],
        "sampling_params": {"max_new_tokens": 1000}}).json()
    whole = fast.chat(content, max_tokens=1000, **kwargs).json()["choices"][0]
    assert head["response_token_ids"] + tail["output_ids"] == whole["response_token_ids"]


# ---------------------------------------------------------------------- slots, queue, abort


def test_slots_queue_limit_and_abort(tmp_path):
    # 2 slots, 1 queue place; each request would take 10 s: only aborts end them here
    sim = Sim(tmp_path, "--slots", "2", "--max-queued", "1", "--decode-tps", "50", "--fixed-tokens", "500")
    try:
        def send(rid):
            with httpx.Client(base_url=sim.url, timeout=30) as c:
                return c.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": rid}], "rid": rid,
                    "max_tokens": 1000, "return_token_ids": True})

        boxes = {}
        for rid, running, queued in (("slow-a", 1, 0), ("slow-b", 2, 0), ("slow-c", 2, 1)):
            boxes[rid] = in_thread(send, rid)
            wait_until(lambda: (sim.stats()["running"], sim.stats()["queued"]) == (running, queued),
                       timeout=10, what=f"{rid} running/queued")
        metrics = sim.client.get("/metrics").text
        assert f'sglang:num_running_reqs{{engine_type="unified",model_name="{MODEL}",' in metrics
        gauges = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if not line.startswith("#")}
        assert gauges["sglang:num_running_reqs"] == 2 and gauges["sglang:num_queue_reqs"] == 1
        assert gauges["sglang:gen_throughput"] == pytest.approx(100.0)
        loads = sim.client.get("/v1/loads").json()
        assert loads["aggregate"]["total_running_reqs"] == 2 and loads["aggregate"]["total_waiting_reqs"] == 1

        full = sim.chat("one too many", max_tokens=10)
        assert full.status_code == 503
        assert full.json() == {"object": "error", "message": "The request queue is full.", "type": "503",
                               "param": None, "code": 503}

        def result(rid):
            boxes[rid]["thread"].join(10)
            assert "result" in boxes[rid], boxes[rid].get("error")
            return boxes[rid]["result"].json()

        assert sim.client.post("/abort_request", json={"rid": "slow-c"}).status_code == 200
        waiting = result("slow-c")  # aborted in the queue: nothing generated
        assert waiting["choices"][0]["finish_reason"] == "abort" and waiting["usage"]["completion_tokens"] == 0
        time.sleep(0.2)  # let slow-a decode a few tokens
        sim.client.post("/abort_request", json={"rid": "slow-a"})
        running = result("slow-a")
        assert running["choices"][0]["finish_reason"] == "abort" and running["choices"][0]["matched_stop"] is None
        assert 0 < running["usage"]["completion_tokens"] < 500
        check_chat_consistency(running)
        gen = in_thread(lambda: httpx.post(f"{sim.url}/generate", timeout=30, json={
            "text": "native prompt", "rid": "gen-1", "sampling_params": {"max_new_tokens": 400}}))
        wait_until(lambda: sim.stats()["running"] == 2, timeout=10, what="gen-1 running")
        sim.client.post("/abort_request", json={"rid": "", "abort_all": True})
        assert result("slow-b")["choices"][0]["finish_reason"] == "abort"
        gen["thread"].join(10)
        assert gen["result"].json()["meta_info"]["finish_reason"]["type"] == "abort"
        stats = sim.stats()
        assert stats["completed"] == {"abort": 4} and stats["errors"] == {"queue_full": 1}
        assert (stats["running"], stats["queued"], stats["max_running_seen"], stats["max_queued_seen"]) == (0, 0, 2, 1)
        assert 0 < stats["busy_slot_seconds"] < 10 * 4
    finally:
        sim.stop()


# ---------------------------------------------------------------------- faults


def classify(sim: Sim, client: httpx.Client, i: int) -> str:
    try:
        r = client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": f"fault {i}"}], "max_tokens": 50})
    except httpx.TimeoutException:
        return "hang"
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return "reset"
    if r.status_code == 503:
        assert r.json()["code"] == 503 and r.json()["object"] == "error"
        return "503"
    assert r.status_code == 200, r.text
    return "ok"


def test_fault_rates_are_as_configured_and_reproducible(tmp_path):
    args = ("--fail-503", "0.15", "--reset-rate", "0.1", "--hang-rate", "0.05", "--hang-seconds", "30",
            "--seed", "0", "--decode-tps", "1e7", "--fixed-tokens", "5")
    timeout = httpx.Timeout(10.0, read=0.5)  # a hang is a read timeout; answers take milliseconds
    sim = Sim(tmp_path, *args)
    try:
        with httpx.Client(base_url=sim.url, timeout=timeout) as client:
            outcomes = [classify(sim, client, i) for i in range(200)]
        counts = {k: outcomes.count(k) for k in ("ok", "503", "reset", "hang")}
        assert 18 <= counts["503"] <= 42 and 10 <= counts["reset"] <= 30 and 3 <= counts["hang"] <= 17, counts
        errors = sim.stats()["errors"]
        assert (errors.get("fault_503"), errors.get("reset"), errors.get("hang")) == (
            counts["503"], counts["reset"], counts["hang"])
        # faults can be changed at runtime
        assert sim.client.post("/sim/faults", json={"fail_503": 1.0, "reset_rate": 0, "hang_rate": 0}).status_code == 200
        assert sim.chat("now always 503").status_code == 503
    finally:
        sim.stop()
    again = Sim(tmp_path, *args)
    try:
        with httpx.Client(base_url=again.url, timeout=timeout) as client:
            assert [classify(again, client, i) for i in range(40)] == outcomes[:40]
    finally:
        again.stop()


def test_startup_then_down_and_back(tmp_path):
    sim = Sim(tmp_path, "--startup-seconds", "1.5", "--decode-tps", "100", "--fixed-tokens", "1000", wait=False)
    try:
        assert wait_until(lambda: sim.health(), timeout=20, what="first answer") == 503  # still starting
        assert sim.chat("too early").status_code == 503
        sim.wait_healthy()
        box = in_thread(sim.chat, "in flight when the server dies", max_tokens=2000)
        wait_until(lambda: sim.stats()["running"] == 1, timeout=10, what="request running")
        assert sim.client.post("/sim/down", json={"seconds": 1.5}).json() == {"down_for": 1.5}
        box["thread"].join(10)
        assert isinstance(box.get("error"), (httpx.RemoteProtocolError, httpx.ReadError)), box

        def refused():
            try:
                httpx.get(f"{sim.url}/health", timeout=1)
            except httpx.ConnectError:
                return True
            return False

        wait_until(refused, timeout=5, what="connections refused while down")
        sim.wait_healthy(timeout=10)
        stats = sim.stats()
        assert stats["down_count"] == 1 and stats["errors"]["killed"] == 1 and stats["running"] == 0
        assert sim.chat("after the restart", max_tokens=5).json()["choices"][0]["finish_reason"] == "length"
    finally:
        sim.stop()


def test_hold_after_lets_that_many_answers_through_then_holds_the_rest(fast):
    """/sim/hold {"after": N}: a test stops a run at a point it chose, however fast the machine."""
    assert fast.client.post("/sim/hold", json={"after": 2}).json() == {"held": False, "after": 2}
    try:
        for i in range(2):
            assert fast.chat(f"let through {i}", max_tokens=8).status_code == 200
        held = in_thread(fast.chat, "held", max_tokens=8)
        wait_until(lambda: fast.stats()["held"] == 1, timeout=10, what="the third answer held")
        assert "result" not in held
    finally:
        fast.client.post("/sim/release")
    held["thread"].join(timeout=10)
    assert held["result"].status_code == 200 and fast.stats()["held"] == 0
    assert fast.client.post("/sim/hold", json={"after": "x"}).status_code == 400
