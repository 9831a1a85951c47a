"""What the project relies on from an SGLang server, written once and run twice: against the
simulated server in `make test` (tests/test_sglang_parity.py) and against the real SGLang 0.5.23
with a tiny model in `make test-sglang` (tests/sglang_real/). Where the two servers differ, a pair
of these checks fails on one side only, and the simulated server is what gets fixed.

Every check takes a `Served` (the server's URL and what it was started with) and, for the
end-to-end ones, a cluster whose gpu0@local worker talks to that server. The checks never assume a
particular text: a row is compared with what the same server answers to the same request, and
with invariants any Qwen3-style thinking output must meet. Both servers must be deterministic
per prompt (the sim is; the tiny model is a bigram table that always says the same thing).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import httpx
from conftest import write_jsonl
from failure_support import check_books, counters, failed_registry

from dflash_tasks.sglang import SGLangClient
from dflash_tasks.sglang.client import TEMPLATE_FIELDS
from dflash_tasks.sglang.errors import InvalidRequest
from dflash_tasks.worker import server_metrics

CONTEXT_LENGTH = 8192   # both servers are started with this context length
SMALL_CAP = 4           # cuts every output while it still thinks
CUT_CAP = 6             # the cap a regenerate --continue starts from
BIG_CAP = 256           # far above either server's whole output: every row stops by itself
QWEN3_THINK, QWEN3_THINK_END, QWEN3_IM_END = 151667, 151668, 151645
METRIC_FAMILIES = {  # what the simulated server serves of the real server's 80-odd families
    f"sglang:{name}": kind for name, kind in (
        ("num_running_reqs", "gauge"), ("num_queue_reqs", "gauge"), ("gen_throughput", "gauge"),
        ("cache_hit_rate", "gauge"), ("token_usage", "gauge"), ("num_used_tokens", "gauge"),
        ("utilization", "gauge"), ("max_total_num_tokens", "gauge"), ("context_len", "gauge"),
        ("prompt_tokens_total", "counter"), ("generation_tokens_total", "counter"),
        ("num_requests_total", "counter"), ("cached_tokens_total", "counter"),
        ("e2e_request_latency_seconds", "histogram"))}


@dataclass(frozen=True)
class Served:
    url: str
    model: str
    kind: str  # "sim" or "real"


def prompts(n: int, prefix: str) -> list[dict]:
    return [{"id": f"{prefix}{i:03d}", "prompt": f"Task {i}: reason about case {i * 104729 % 9973}."}
            for i in range(n)]


def fresh_chat(s: Served, messages: list[dict], max_tokens: int, **extra) -> dict:
    """The server's own answer to one request, as the worker sends it."""
    body = {"model": s.model, "messages": messages, "max_tokens": max_tokens,
            "chat_template_kwargs": {"enable_thinking": True}, "separate_reasoning": True,
            "return_token_ids": True, "temperature": 0.6, **extra}
    r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def check_thinking_row(row: dict) -> None:
    """What any row of a thinking model must be: reasoning and answer apart, counts that agree
    with the token ids, markers neither in the answer nor in the reasoning."""
    meta, answer = row["metadata"], row["conversations"][-1]
    ids = row["token_ids"]
    assert answer["role"] == "assistant"
    assert meta["completion_tokens"] == len(ids["response"]) > 0
    assert meta["prompt_tokens"] == len(ids["prompt"]) > 0
    assert ids["response"][0] == QWEN3_THINK and ids["prompt"][-1] != QWEN3_THINK
    reasoning, content = answer["reasoning_content"] or "", answer["content"] or ""
    assert reasoning.strip(), row
    for marker in ("<think>", "</think>", "<|im_end|>"):
        assert marker not in reasoning and marker not in content, (marker, row)
    if QWEN3_THINK_END in ids["response"]:  # SGLang counts every token up to and including </think>
        assert meta["reasoning_tokens"] == ids["response"].index(QWEN3_THINK_END) + 1
    else:
        assert meta["reasoning_tokens"] == meta["completion_tokens"] and content == ""
    if meta["finish_reason"] == "stop":
        assert row["status"] == "success" and ids["response"][-1] == QWEN3_IM_END
        assert content.strip(), row
    else:
        assert meta["finish_reason"] == "length" and row["status"] == "truncated"
        assert meta["completion_tokens"] == meta["max_tokens"]


def same_as_fresh(s: Served, row: dict) -> None:
    """A row says exactly what the server answers to a fresh request at the row's cap."""
    meta, answer = row["metadata"], row["conversations"][-1]
    fresh = fresh_chat(s, row["conversations"][:-1], meta["max_tokens"])
    choice, usage = fresh["choices"][0], fresh["usage"]
    assert choice["response_token_ids"] == row["token_ids"]["response"], row["id"]
    assert choice["prompt_token_ids"] == row["token_ids"]["prompt"], row["id"]
    assert choice["finish_reason"] == meta["finish_reason"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["reasoning_tokens"]) == \
           (meta["prompt_tokens"], meta["completion_tokens"], meta["reasoning_tokens"])
    # Exactly, whitespace and all: a continued row's text is the server's decoding of its ids.
    assert choice["message"]["reasoning_content"] == answer["reasoning_content"], row["id"]
    assert choice["message"]["content"] == answer["content"], row["id"]


# ---------------------------------------------------------------------------- the HTTP surface


def check_http_surface(s: Served) -> None:
    """The endpoints and shapes the client reads, and the error shapes it classifies."""
    client = SGLangClient(s.url)
    try:
        assert client.healthy()
        assert client.served_model() == s.model
        assert httpx.get(s.url + "/health_generate", timeout=60).status_code == 200
        info = client.server_info()
        assert info["version"] == "0.5.23", info.get("version")
        # The thinking contract every row records (client.ServerContract): the launch arguments
        # that choose the template are in /server_info, and the parser it was started with.
        assert set(TEMPLATE_FIELDS) <= set(info) and info["tokenizer_path"], \
            {k: info.get(k) for k in TEMPLATE_FIELDS}
        contract = client.contract()
        assert contract.reasoning_parser == "qwen3" and contract.chat_template.startswith("sha256:")
        model_info = httpx.get(s.url + "/model_info", timeout=10).json()
        assert model_info["served_model_name"] == s.model and model_info["is_generation"] is True
        models = httpx.get(s.url + "/v1/models", timeout=10).json()
        assert models["data"][0]["max_model_len"] == CONTEXT_LENGTH

        done = client.chat([{"role": "user", "content": "Task 1: hello"}], max_tokens=BIG_CAP,
                           sampling={"temperature": 0.6})
        assert done.finish_reason == "stop" and done.reasoning_content and done.content
        assert done.completion_tokens == len(done.response_token_ids)
        assert done.prompt_tokens == len(done.prompt_token_ids)
        assert done.matched_stop == QWEN3_IM_END
        cut = client.chat([{"role": "user", "content": "Task 1: hello"}], max_tokens=SMALL_CAP)
        assert (cut.finish_reason, cut.completion_tokens, cut.content) == ("length", SMALL_CAP, "")
        assert cut.reasoning_tokens == SMALL_CAP and cut.matched_stop is None
        assert cut.response_token_ids == done.response_token_ids[:SMALL_CAP]

        # /generate continues from token ids; the prefix cache serves the known part.
        g = client.generate(cut.prompt_token_ids + cut.response_token_ids,
                            max_new_tokens=BIG_CAP, rid="surface-continue")
        assert cut.response_token_ids + g.output_ids == done.response_token_ids
        assert (g.finish_reason, g.matched_stop) == ("stop", QWEN3_IM_END)
        assert g.completion_tokens == len(g.output_ids)
        assert g.cached_tokens > 0
        raw = httpx.post(s.url + "/generate", timeout=60, json={
            "input_ids": cut.prompt_token_ids, "sampling_params": {"max_new_tokens": 2}}).json()
        assert raw["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
        assert raw["output_ids"] == done.response_token_ids[:2]

        # Errors: 400 with the OpenAI error object, fixed messages.
        r = httpx.post(s.url + "/v1/chat/completions", timeout=30,
                       json={"model": s.model, "messages": [], "max_tokens": 4})
        assert r.status_code == 400
        assert r.json() == {"object": "error", "message": "Messages cannot be empty.",
                            "type": "BadRequestError", "param": None, "code": 400}
        too_long = [{"role": "user", "content": " ".join(f"w{j}" for j in range(9000))}]
        try:
            client.chat(too_long, max_tokens=16)
            raise AssertionError("a prompt longer than the context was accepted")
        except InvalidRequest as exc:
            assert exc.status == 400 and "is longer than the model's context length (8192 tokens)" in str(exc)
        r = httpx.post(s.url + "/generate", timeout=30, json={
            "input_ids": [cut.prompt_token_ids[0]] * 9000, "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 400
        assert r.json() == {"error": {"message": "The input (9000 tokens) is longer than the "
                                                 "model's context length (8192 tokens)."}}
        r = httpx.post(s.url + "/generate", timeout=30, json={
            "input_ids": cut.prompt_token_ids, "sampling_params": {"max_new_tokens": CONTEXT_LENGTH}})
        assert r.status_code == 400
        n = len(cut.prompt_token_ids)
        assert r.json()["error"]["message"] == (
            f"Requested token count exceeds the model's maximum context length of {CONTEXT_LENGTH} "
            f"tokens. You requested a total of {n + CONTEXT_LENGTH} tokens: {n} tokens from the "
            f"input messages and {CONTEXT_LENGTH} tokens for the completion. Please reduce the "
            f"number of tokens in the input messages or the completion to fit within the limit.")

        # /metrics into the per-GPU view: every family we read is there.
        sample = server_metrics.sample(client)
        assert sample["error"] is None, sample
        assert set(server_metrics.FAMILIES.values()) <= set(sample), sample
        text = client.metrics_text()
        types = {line.split()[2]: line.split()[3] for line in text.splitlines()
                 if line.startswith("# TYPE sglang:")}
        missing = {name: kind for name, kind in METRIC_FAMILIES.items() if types.get(name) != kind}
        assert not missing, f"families missing or of another type: {missing}"
    finally:
        client.close()


# ---------------------------------------------------------------------------- end to end


def check_job_end_to_end(c, s: Served, tmp_path: Path) -> None:
    """A small job through a real worker: rows with reasoning and answer apart, token ids kept,
    usage counted exactly, finish_reason 'stop' under a large cap and 'length' under a small one,
    and the server's own load read from its /metrics into status's per-GPU view."""
    rows = prompts(6, "e")
    path = write_jsonl(tmp_path / "e2e.jsonl", rows)
    c.manage("enqueue", "--dataset", str(path), "--job", "stops", "--max-output-tokens", str(BIG_CAP))
    c.wait_done("stops", timeout=240)
    out = check_books(c, "stops", {r["id"] for r in rows})
    assert {r["metadata"]["finish_reason"] for r in out} == {"stop"}
    contract = SGLangClient(s.url).contract()
    for row in out:
        check_thinking_row(row)
        assert row["metadata"]["model"] == s.model and row["metadata"]["gpu"] == c.gpu(0)
        assert (row["metadata"]["chat_template"], row["metadata"]["reasoning_parser"]) == \
            (contract.chat_template, "qwen3")
    same_as_fresh(s, out[0])
    snap = c.status("stops")
    assert snap["finish_reasons"] == {"stop": len(rows)}

    path = write_jsonl(tmp_path / "cut.jsonl", prompts(4, "c"))
    c.manage("enqueue", "--dataset", str(path), "--job", "cuts", "--max-output-tokens", str(SMALL_CAP))
    c.wait_done("cuts", timeout=240)
    out = check_books(c, "cuts", {f"c{i:03d}" for i in range(4)})
    for row in out:
        check_thinking_row(row)
        assert (row["metadata"]["finish_reason"], row["metadata"]["completion_tokens"]) == ("length", SMALL_CAP)
    same_as_fresh(s, out[0])
    assert c.status("cuts")["total_output_tokens"] == 4 * SMALL_CAP

    server = c.status("stops")["gpus"][c.gpu(0)]["server"]
    assert server["error"] is None, server
    for key in ("running", "queued", "gen_throughput", "token_usage", "cache_hit_rate"):
        assert isinstance(server[key], (int, float)), (key, server)
    assert "server:" in c.manage("status", "--job", "stops").stdout


def check_context_errors(c, s: Served, tmp_path: Path) -> None:
    """Requests over the context length are permanent failures, one attempt each, with the
    server's own message; the rest of the job completes."""
    good = prompts(3, "g")
    huge = [{"id": "huge", "prompt": " ".join(f"w{j}" for j in range(9000))}]
    path = write_jsonl(tmp_path / "ctx.jsonl", good + huge)
    c.manage("enqueue", "--dataset", str(path), "--job", "ctx", "--max-output-tokens", "64")
    c.wait_done("ctx", timeout=240)
    check_books(c, "ctx", {r["id"] for r in good}, {"huge"})
    rec = failed_registry(c, "ctx")["huge"]
    assert (rec["reason"], rec["class"], rec["attempts"], rec["status"]) == \
           ("invalid_request", "permanent", 1, 400), rec
    assert "is longer than the model's context length (8192 tokens)" in rec["error"], rec

    # Input fits, input + cap does not.
    path = write_jsonl(tmp_path / "cap.jsonl", prompts(1, "k"))
    c.manage("enqueue", "--dataset", str(path), "--job", "capped", "--max-output-tokens", str(CONTEXT_LENGTH))
    c.wait_done("capped", timeout=240)
    rec = failed_registry(c, "capped")["k000"]
    assert (rec["reason"], rec["class"], rec["attempts"], rec["status"]) == \
           ("invalid_request", "permanent", 1, 400), rec
    assert "exceeds the model's maximum context length of 8192 tokens" in rec["error"], rec
    assert counters(c, "ctx").get("retries", 0) == counters(c, "capped").get("retries", 0) == 0


def check_regenerate_continue(c, s: Served, tmp_path: Path) -> None:
    """regenerate --continue through /generate: rows cut at a small cap go on from their own
    token ids after the cap is raised, and each ends exactly as one generation at the new cap."""
    rows = prompts(4, "r")
    path = write_jsonl(tmp_path / "regen.jsonl", rows)
    c.manage("enqueue", "--dataset", str(path), "--job", "regen", "--max-output-tokens", str(CUT_CAP))
    c.wait_done("regen", timeout=240)
    cut = check_books(c, "regen", {r["id"] for r in rows})
    assert all(r["metadata"]["finish_reason"] == "length" for r in cut)
    c.manage("set", "--job", "regen", "--max-output-tokens", str(BIG_CAP))
    out = c.manage("regenerate", "--job", "regen", "--finish-reason", "length", "--continue").stdout
    assert f"{len(rows) * CUT_CAP:,} tokens reused" in out, out
    c.wait_done("regen", timeout=240)
    newest = {}
    for row in c.rows("regen"):
        newest[row["id"]] = row
    assert set(newest) == {r["id"] for r in rows}
    for row in newest.values():
        assert row["metadata"]["continued_tokens"] == CUT_CAP
        assert row["metadata"]["finish_reason"] == "stop"
        check_thinking_row(row)
        same_as_fresh(s, row)
    snap = c.status("regen")
    assert snap["completed"] == len(rows)
    assert snap["total_output_tokens"] == sum(r["metadata"]["completion_tokens"] for r in newest.values())


ABORT_TOKENS = 2000  # long enough to abort it while it runs, on either server


def check_abort_and_continue(s: Served) -> None:
    """What moving a generation to another GPU relies on (issue 29): /abort_request answers 200
    with an empty body; the aborted request's own answer completes normally, finish_reason
    "abort", with its partial output and token ids; continuing from the prompt's ids and those
    with /generate gives, id for id, what one uninterrupted greedy generation gives. The real
    tiny model would stop after its short script: it is asked to ignore its end token."""
    import threading
    import time

    messages = [{"role": "user", "content": "Count slowly, one number at a time."}]
    greedy = {"temperature": 0, **({"ignore_eos": True} if s.kind == "real" else {})}
    started = time.monotonic()
    whole = fresh_chat(s, messages, ABORT_TOKENS, **greedy)["choices"][0]
    whole_s = time.monotonic() - started
    whole_ids = whole["response_token_ids"]
    assert len(whole_ids) > 100, len(whole_ids)
    got: dict = {}
    rid = f"abort-check-{time.time_ns()}"
    running = threading.Thread(target=lambda: got.update(
        answer=fresh_chat(s, messages, ABORT_TOKENS, rid=rid, **greedy)))
    running.start()
    # Half-way through, by this server's own time for the whole generation a moment ago (a fixed
    # delay would abort too early on a slow machine, or after the end on a fast one).
    time.sleep(whole_s / 2)
    aborted = httpx.post(s.url + "/abort_request", json={"rid": rid}, timeout=30)
    assert aborted.status_code == 200 and aborted.content == b"", (aborted.status_code, aborted.text)
    running.join(timeout=120)
    choice = got["answer"]["choices"][0]
    assert choice["finish_reason"] == "abort", dump(choice)
    partial = choice["response_token_ids"]
    assert 0 < len(partial) < len(whole_ids), (len(partial), len(whole_ids))
    assert partial == whole_ids[:len(partial)]
    sampling = {"max_new_tokens": len(whole_ids) - len(partial), "temperature": 0,
                **({"ignore_eos": True} if s.kind == "real" else {})}
    rest = httpx.post(s.url + "/generate", json={"input_ids": choice["prompt_token_ids"] + partial,
                                                 "sampling_params": sampling}, timeout=120)
    assert rest.status_code == 200, rest.text
    assert partial + rest.json()["output_ids"] == whole_ids


def dump(obj) -> str:
    return json.dumps(obj, indent=1)[:2000]


# ---------------------------------------------------------------------------- continued rows


# Sent whole, the same, to both endpoints: the chat endpoint fills an unset one from the model's
# generation_config.json, /generate never does (docs/SGLANG_0.5.23.md, (d)).
SAME_SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                 "repetition_penalty": 1.0}


def chat_raw(s: Served, messages: list[dict], max_tokens: int, *, enable_thinking: bool = True,
             **sampling) -> dict:
    """One chat completion as the worker asks for it, the whole answer."""
    body = {"model": s.model, "messages": messages, "max_tokens": max_tokens,
            "chat_template_kwargs": {"enable_thinking": enable_thinking},
            "separate_reasoning": True, "return_token_ids": True, **sampling}
    r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def generate_raw(s: Served, input_ids: list[int], max_new_tokens: int, **sampling) -> dict:
    r = httpx.post(s.url + "/generate", timeout=120, json={
        "input_ids": input_ids, "sampling_params": {**sampling, "max_new_tokens": max_new_tokens}})
    assert r.status_code == 200, r.text
    return r.json()


def qwen3_split(text: str, *, force_reasoning: bool) -> tuple[str | None, str]:
    """(reasoning_content, content) as SGLang 0.5.23's non-streaming chat path gives them with
    `--reasoning-parser qwen3`: BaseReasoningFormatDetector._detect_and_parse_impl
    (srt/parser/reasoning_parser.py) and serving_chat._build_chat_response (an empty reasoning is
    null, an empty answer ""). Nothing is stripped but leading `<think>` tags."""
    if not (force_reasoning or "<think>" in text):
        return None, text
    while text.startswith("<think>"):
        text = text[len("<think>"):]
    if "</think>" not in text:
        tool = text.find("<tool_call>")
        reasoning, content = (text[:tool], text[tool:]) if tool != -1 else (text, "")
    else:
        reasoning, content = text.split("</think>", 1)
    return reasoning or None, content


def reference_row(s: Served, prompt_ids: list[int], response_ids: list[int], finish_reason: str,
                  matched_stop, *, enable_thinking: bool) -> dict:
    """A reference decoding, independent of the project: the text of all the response ids
    at once from the server's own tokenizer (/v1/detokenize, special tokens skipped as on the
    chat endpoint), split as the qwen3 parser splits it, reasoning_tokens counted as SGLang
    counts them (every token up to and including the first </think>; thinking off: 0)."""
    r = httpx.post(s.url + "/v1/detokenize", timeout=30, json={
        "model": s.model, "tokens": response_ids, "skip_special_tokens": True})
    assert r.status_code == 200, r.text
    reasoning, content = qwen3_split(r.json()["text"], force_reasoning=enable_thinking)
    if not enable_thinking:
        reasoning_tokens = 0
    elif QWEN3_THINK_END in response_ids:
        reasoning_tokens = response_ids.index(QWEN3_THINK_END) + 1
    else:
        reasoning_tokens = len(response_ids)
    return {"content": content, "reasoning_content": reasoning, "response_ids": response_ids,
            "reasoning_tokens": reasoning_tokens, "finish_reason": finish_reason,
            "matched_stop": matched_stop}


def project_row(s: Served, prompt_ids: list[int], response_ids: list[int], finish_reason: str,
                matched_stop, *, enable_thinking: bool) -> dict:
    """The project's decoding of a generation made in several requests: Ongoing.finished
    (dflash_tasks/sglang/ongoing.py: /v1/detokenize of all the ids, reasoning.split_reasoning,
    ongoing.reasoning_tokens). reference_row holds the same facts without the project's code."""
    from dflash_tasks.core.jobs import GenerationParams
    from dflash_tasks.sglang.ongoing import Ongoing

    client = SGLangClient(s.url)
    try:
        done = Ongoing(list(prompt_ids), list(response_ids),
                       GenerationParams(enable_thinking=enable_thinking),
                       finish_reason=finish_reason, matched_stop=matched_stop
                       ).finished(client, reasoning_parser="qwen3")
    finally:
        client.close()
    return {"content": done.content, "reasoning_content": done.reasoning_content,
            "response_ids": list(done.response_token_ids or ()),
            "reasoning_tokens": done.reasoning_tokens, "finish_reason": done.finish_reason,
            "matched_stop": done.matched_stop}


# Who decodes a continued generation in check_cut_at_every_offset: the local reference (the
# server's facts, always) and the project (what its rows hold).
ROW_DECODERS = {"reference": reference_row, "project": project_row}


DECODE_TIMEOUT_S = 60


def within(seconds: float, fn, *args, **kwargs):
    """fn(*args, **kwargs), or TimeoutError after `seconds` (a hung call is left behind in a
    daemon thread rather than hanging the test run)."""
    import threading

    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed back to the caller below
            out["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not return in {seconds} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


def uncut_row(answer: dict) -> dict:
    choice, usage = answer["choices"][0], answer["usage"]
    return {"content": choice["message"]["content"],
            "reasoning_content": choice["message"]["reasoning_content"],
            "response_ids": choice["response_token_ids"],
            "reasoning_tokens": usage["reasoning_tokens"], "finish_reason": choice["finish_reason"],
            "matched_stop": choice.get("matched_stop")}


def check_cut_at_every_offset(s: Served, script: dict | None = None) -> None:
    """A generation cut after k tokens, for every k from 1 to its length - 1, and continued
    through /generate from prompt ids + the ids so far, decodes to exactly the chat endpoint's
    answer to one uncut request: content, reasoning_content, response ids, reasoning_tokens,
    finish_reason, matched_stop, field for field, whitespace and all. The continuation itself is
    cut once more (a second /generate) at a point that moves with k, so boundaries between two
    /generate requests fall everywhere too. With the tiny real model (`script`: its
    script.json) the cuts fall inside CJK characters and an emoji split across byte-level
    tokens, right before and after `</think>`, and right after `<think>`; thinking off, the
    output is the answer alone. Joining each request's text would lose those characters (the
    detokenizer decodes a request's first tokens after 5 ids of context that end inside the
    character) and misfile an answer cut right after `</think>`: only decoding all ids at once
    gives the uncut row."""
    messages = [{"role": "user", "content": "Task 7: explain the cut."}]
    for thinking in (True, False):
        uncut = chat_raw(s, messages, BIG_CAP, enable_thinking=thinking, **SAME_SAMPLING)
        want = uncut_row(uncut)
        prompt_ids = uncut["choices"][0]["prompt_token_ids"]
        ids = want["response_ids"]
        assert want["finish_reason"] == "stop" and len(ids) > 2, dump(uncut)
        if script is not None and thinking:
            assert ids == script["script_ids"], (ids, script["script_ids"])
            expected = (script["content"], script["reasoning_content"], script["reasoning_tokens"])
            assert (want["content"], want["reasoning_content"], want["reasoning_tokens"]) == \
                   expected, want
        if script is not None and not thinking:  # the prompt ends with "\n\n": the answer alone
            tail = script["script_ids"][script["think_end_index"] + 2:]
            assert ids == tail and want["reasoning_content"] is None, want
            assert want["content"] == script["content"].lstrip("\n") and \
                   want["reasoning_tokens"] == 0, want
        failures = []
        decoders = dict(ROW_DECODERS)
        for k in range(1, len(ids)):
            first = chat_raw(s, messages, k, enable_thinking=thinking, **SAME_SAMPLING)
            head = first["choices"][0]["response_token_ids"]
            assert head == ids[:k] and first["choices"][0]["finish_reason"] == "length", (k, head)
            so_far = list(head)
            split = k + 1 + k % 3  # the second /generate starts here, when there is one
            for until in ((split, len(ids)) if split < len(ids) else (len(ids),)):
                g = generate_raw(s, prompt_ids + so_far, BIG_CAP if until == len(ids)
                                 else until - len(so_far), **SAME_SAMPLING)
                so_far += g["output_ids"]
            finish = g["meta_info"]["finish_reason"]
            assert so_far == ids, (k, so_far, ids)
            for name, decode in list(decoders.items()):
                try:
                    got = within(DECODE_TIMEOUT_S, decode, s, prompt_ids, so_far, finish["type"],
                                 finish.get("matched"), enable_thinking=thinking)
                except Exception as exc:  # one broken decoder must not hide the others' results
                    failures.append((name, thinking, k, f"raised {exc!r}"))
                    del decoders[name]
                    continue
                if got != want:
                    failures.append((name, thinking, k, {f: (got[f], want[f]) for f in want
                                                         if got[f] != want[f]}))
        assert not failures, "continued rows differ from the uncut one (decoder, thinking, k, " \
                             "{field: (got, uncut)}):\n" + "\n".join(map(repr, failures))


def check_sampling_defaults(s: Served, script: dict) -> None:
    """The tiny model's penalty variant (generation_config.json: repetition_penalty 1.05,
    min_p 0.5; a trap at script["penalty"]["trap_index"] that only the penalty avoids). The
    chat endpoint applies generation_config's values to whatever the request leaves unset,
    /generate never does and no endpoint reports them: the two sample alike only when the client
    sends the same parameters to both. And SGLang's penalties count a request's own output ids
    (plus its last input id), not the rest of its input: a penalised generation continued
    through /generate leaves the uncut one when the cut drops the penalised token from view."""
    pen = script["penalty"]
    ids, trap, said = script["script_ids"], pen["trap_index"], pen["trap_token_index"]
    same = {"repetition_penalty": pen["repetition_penalty"], "min_p": pen["min_p"]}
    messages = [{"role": "user", "content": "Task 3: the defaults."}]
    info = httpx.get(s.url + "/server_info", timeout=30).json()
    model_info = httpx.get(s.url + "/model_info", timeout=10).json()
    assert info["sampling_defaults"] == "model" and info["preferred_sampling_params"] is None
    assert model_info["preferred_sampling_params"] is None  # generation_config's values: nowhere
    # Chat, nothing sent but the temperature: generation_config's penalty keeps it on the script,
    # at any temperature (min_p 0.5 leaves one candidate at every step).
    for temperature in (0, 1, 1):
        answer = chat_raw(s, messages, 64, temperature=temperature)["choices"][0]
        assert answer["response_token_ids"] == ids, (temperature, answer["response_token_ids"])
    prompt_ids = answer["prompt_token_ids"]
    # Asked for no penalty, the chat endpoint falls into the trap as /generate does by default.
    trapped = chat_raw(s, messages, 64, temperature=0, repetition_penalty=1.0)["choices"][0]
    plain = generate_raw(s, prompt_ids, 64, temperature=0)
    assert trapped["response_token_ids"] == plain["output_ids"]
    assert plain["output_ids"][:trap] == ids[:trap]
    assert plain["output_ids"][trap] == pen["trap_token"]
    assert plain["meta_info"]["finish_reason"]["type"] == "length"  # it loops
    # /generate with the same parameters as the chat endpoint used: the same output.
    for temperature in (0, 1, 1):
        g = generate_raw(s, prompt_ids, 64, temperature=temperature, **same)
        assert g["output_ids"] == ids, (temperature, g["output_ids"])
    # Continued from a cut with the same parameters: the same output only while the token the
    # penalty holds back (said at `said`) is in the request's own view (its last input id) or
    # the trap is behind.
    diverged = []
    for k in range(1, len(ids)):
        g = generate_raw(s, prompt_ids + ids[:k], len(ids) - k, temperature=0, **same)
        if ids[:k] + g["output_ids"] != ids:
            diverged.append(k)
    assert diverged == list(range(said + 2, trap + 1)), diverged
