"""A continued generation is the row one uninterrupted request gives (sglang/ongoing.py).

The simulated server runs its byte-level tokenizer (dflash_dev/sim/tokens.py): every output token
is one byte of a text of Chinese, emoji and English, so a cut between two requests nearly always
falls inside a character, and a request's own text is decoded from its ids alone, as SGLang's is.
Texts of requests joined would then not be the text of the generation; only decoding all its ids
at once is. Each test compares every row, field for field, with a fresh uninterrupted request to
a server of the same kind (the simulated model, like SGLang at temperature 0, goes on from a
sequence exactly as it would have). `make test-sglang` holds the same against the real server
(tests/sglang_checks.py's check_cut_at_every_offset).
"""
from __future__ import annotations

import httpx
import pytest
from conftest import write_jsonl
from failure_support import check_books, counters, prompts, sim_hold, sim_release

from dflash_dev.local import wait_until
from dflash_dev.sim import tokens
from dflash_tasks.core.jobs import request_seed

NATURAL = 24           # every output's natural length (--fixed-tokens)
BYTES = ("--tokenizer", "bytes", "--fixed-tokens", str(NATURAL))


def uninterrupted(url: str, prompt: str, cap: int, **sampling) -> dict:
    """One request's answer, as the worker asks it."""
    body = {"model": "Qwen/Qwen3-8B", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": cap, "return_token_ids": True, "separate_reasoning": True,
            "chat_template_kwargs": {"enable_thinking": True}, **sampling}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def assert_same_row(row: dict, answer: dict) -> None:
    """The row is the answer of one request, field for field."""
    choice, usage = answer["choices"][0], answer["usage"]
    meta, turn = row["metadata"], row["conversations"][-1]
    assert turn["content"] == choice["message"]["content"], row["id"]
    assert turn["reasoning_content"] == choice["message"]["reasoning_content"], row["id"]
    assert row["token_ids"]["response"] == choice["response_token_ids"], row["id"]
    assert row["token_ids"]["prompt"] == choice["prompt_token_ids"], row["id"]
    assert meta["finish_reason"] == choice["finish_reason"], row["id"]
    assert meta["completion_tokens"] == usage["completion_tokens"], row["id"]
    assert meta["reasoning_tokens"] == usage["reasoning_tokens"], row["id"]
    assert meta["prompt_tokens"] == usage["prompt_tokens"], row["id"]


def inside_a_character(ids: list[int], at: int) -> bool:
    """Whether a cut before position `at` of byte-level ids splits a character."""
    return 0 < at < len(ids) and ids[at] < 256 and ids[at] & 0xC0 == 0x80


@pytest.mark.timeout(400)
def test_regenerate_continue_at_every_offset_gives_the_uninterrupted_row(cluster, tmp_path):
    """40 prompts cut at 12 tokens, then continued by `regenerate --continue` 3 tokens at a time
    up to their natural end: each prompt's `</think>` falls elsewhere (its share of reasoning), so
    the cuts land inside characters, just before `</think>`, at it and just after it. Every
    final row equals one uninterrupted request's."""
    c = cluster()
    c.start_server(0, *BYTES)
    c.start_worker(0)
    c.start_beat()
    rows = prompts(40)
    c.manage("enqueue", "--dataset", str(write_jsonl(tmp_path / "d.jsonl", rows)), "--job", "cut",
             "--max-output-tokens", "12")
    c.wait_done("cut")
    cut_at: dict[str, list[int]] = {}  # where each prompt's requests ended before its last
    for cap in range(15, NATURAL + 1, 3):
        for r in c.rows("cut")[-len(rows):]:  # each prompt's newest row, all cut so far
            assert r["metadata"]["finish_reason"] == "length", r["metadata"]
            cut_at.setdefault(r["id"], []).append(r["metadata"]["completion_tokens"])
        c.manage("set", "--job", "cut", "--max-output-tokens", str(cap))
        c.manage("regenerate", "--job", "cut", "--finish-reason", "length", "--continue")
        c.wait_done("cut")
    done = {r["id"]: r for r in c.rows("cut")}  # batches in order: the newest row of each id last
    assert set(done) == {r["id"] for r in rows}
    c.start_server(1, *BYTES)
    reference = c.url(1)
    for row in rows:
        answer = uninterrupted(reference, row["prompt"], NATURAL)
        assert_same_row(done[row["id"]], answer)
        meta = done[row["id"]]["metadata"]
        assert meta["continued_tokens"] > 0 and sum(g["tokens"] for g in meta["gpus"]) == \
            meta["completion_tokens"], meta
    # The cuts this run went on from: what a stitched text gets wrong happened, and was right.
    cuts = [(done[i]["token_ids"]["response"], at) for i, ats in cut_at.items() for at in ats]
    assert sum(inside_a_character(ids, at) for ids, at in cuts) > len(rows)
    assert any(ids[at - 1] == tokens.END_THINK for ids, at in cuts)         # just after </think>
    assert any(ids[at] == tokens.END_THINK for ids, at in cuts)             # just before it
    assert counters(c, "cut")["output_tokens"] == sum(
        r["metadata"]["completion_tokens"] for r in done.values())


@pytest.mark.timeout(400)
def test_rounds_keep_the_parameters_they_started_with_and_sample_alike(cluster, tmp_path):
    """A job in rounds on a model whose generation_config.json sets repetition_penalty and min_p
    (the chat endpoint would fill them in, /generate would not). Its temperature is changed while
    the first requests are held: every generation goes on with the parameters it started with,
    its row records them, and each of its requests, chat or /generate, sampled with the same
    parameters. The thinking mode cannot be changed once the job exists."""
    # Rounds of 8 tokens (deployed: 2,048), so that 40-token generations go on four times.
    c = cluster(endgame_round_tokens="8")
    sim = ("--tokenizer", "bytes", "--fixed-tokens", "40", "--slots", "2",
           "--generation-config", "repetition_penalty=1.05,min_p=0.05")
    c.start_server(0, *sim)
    c.start_worker(0, "--concurrency", "2")
    c.start_beat()
    url = c.url(0)
    sim_hold(url)
    rows = prompts(6)
    c.manage("enqueue", "--dataset", str(write_jsonl(tmp_path / "d.jsonl", rows)), "--job", "p",
             "--temperature", "0.6")
    started = wait_until(lambda: len(httpx.get(f"{url}/sim/sampling").json()) == 2 and
                         httpx.get(f"{url}/sim/sampling").json(), timeout=60,
                         what="the first two requests")
    refused = c.manage("set", "--job", "p", "--no-thinking", check=False)
    assert refused.returncode != 0 and "thinking mode is fixed" in refused.stderr, refused.stderr
    c.manage("set", "--job", "p", "--temperature", "0.9")
    sim_release(url)
    c.wait_done("p")
    done = check_books(c, "p", {r["id"] for r in rows})
    first = {s["rid"].split(":")[2] for s in started}
    by_prompt: dict[str, list[dict]] = {}
    for seen in httpx.get(f"{url}/sim/sampling").json():
        by_prompt.setdefault(seen["rid"].split(":")[2], []).append(seen)
    for row in done:
        meta = row["metadata"]
        assert meta["temperature"] == (0.6 if row["id"] in first else 0.9), meta
        assert meta["enable_thinking"] is True
        requests = by_prompt[row["id"]]
        assert len(requests) > 1 and requests[0]["endpoint"] == "chat", requests
        assert {tuple(sorted(r["sampling"].items())) for r in requests} == {tuple(sorted({
            "temperature": meta["temperature"], "top_p": meta["top_p"], "top_k": meta["top_k"],
            "min_p": meta["min_p"], "repetition_penalty": meta["repetition_penalty"]}.items()))}
        # and with the prompt's own seed, chat's `seed` then /generate's `sampling_seed`
        assert {r["seed"] for r in requests} == {request_seed("p", row["id"])}, requests
    assert counters(c, "p")["rounds"] >= len(done)


@pytest.mark.parametrize("text, thinking, want", [
    ("<think>\nLet me see.\n</think>\n\nIt is 42.", True, ("\nLet me see.\n", "\n\nIt is 42.")),
    ("<think>\nstill thinking", True, ("\nstill thinking", "")),
    ("<think>\nall of it\n</think>", True, ("\nall of it\n", "")),     # cut right after </think>
    ("<think>", True, (None, "")),                                      # cut after <think>
    ("<think><think>x</think>y", True, ("x", "y")),
    ("no markers at all", True, ("no markers at all", "")),            # thinking forces reasoning
    ("It is 42.", False, (None, "It is 42.")),
    ("<think>a</think>b", False, ("a", "b")),
    ("<think>\nlooking it up <tool_call>{}", True, ("\nlooking it up ", "<tool_call>{}")),
])
def test_the_split_is_sglangs_qwen3_parser(text, thinking, want):
    """What SGLang 0.5.23's qwen3 parser answers for a whole text (read in its source,
    docs/REAL_SGLANG.md): nothing stripped, an empty reasoning null. The simulated server's copy
    answers the same."""
    from dflash_dev.sim.server import split_reasoning as sim_split
    from dflash_tasks.sglang.reasoning import split_reasoning

    assert split_reasoning(text, parser="qwen3", enable_thinking=thinking) == want
    assert sim_split(text, thinking) == want
    assert split_reasoning(text, parser=None, enable_thinking=thinking) == (None, text)


def test_a_generation_at_or_past_the_cap_ends_there_with_its_shares_cut():
    """An entry holding the job's whole cap and no finish (a move aborted as it reached the cap,
    or the cap lowered since) ends at the cap: its first ids, each GPU's share up to them."""
    from dflash_tasks.core.jobs import GenerationParams
    from dflash_tasks.sglang.ongoing import Ongoing, Share

    made = Ongoing([1, 2], list(range(100, 114)), GenerationParams(max_tokens=10),
                   (Share("gpu0@a", 6, 1.0), Share("gpu1@a", 8, 2.0)), prefix_tokens=6, parts=2)
    at_cap = made.cut_at(10)
    assert at_cap.response_ids == list(range(100, 110)) and at_cap.finish_reason == "length"
    assert at_cap.shares == (Share("gpu0@a", 6, 1.0), Share("gpu1@a", 4, 2.0))
    assert at_cap.prefix_tokens == 6 and at_cap.matched_stop is None
    lowered = made.cut_at(4)
    assert lowered.shares == (Share("gpu0@a", 4, 1.0),) and lowered.prefix_tokens == 4
    assert made.cut_at(14).response_ids == made.response_ids
