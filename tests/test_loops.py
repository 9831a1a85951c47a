"""Loops named per row (issue 41, item 1): the detector (output/loops.py) on constructed and
random sequences and on the simulated model's own outputs, natural and looping; then a job on
the simulated server told to loop on a share of prompts: every row marked as the server made
it, the counters split the truncated rows exactly, through a continuation too, and the training
gate drops the looping rows and says how many."""
from __future__ import annotations

import json

from conftest import write_jsonl
from hypothesis import given, settings
from hypothesis import strategies as st
from test_pipeline import start

from dflash_dev.sim import lengths, tokens
from dflash_tasks.output.loops import MAX_PERIOD, MIN_REPEATS, MIN_TOKENS, tail_loop

LOOP_SHARE = 0.1


def _smallest_period(block: list[int]) -> int:
    """The period of `block` repeated: the length of its primitive root."""
    return next(p for p in range(1, len(block) + 1)
                if len(block) % p == 0 and block == block[:p] * (len(block) // p))


@settings(max_examples=200, deadline=None)
@given(prefix=st.lists(st.integers(0, 151_000), max_size=600),
       block=st.lists(st.integers(0, 151_000), min_size=1, max_size=300),
       copies=st.integers(1, 40), cut=st.integers(0, 299))
def test_a_loop_at_the_tail_is_found_with_its_period(prefix, block, copies, cut):
    period = _smallest_period(block)
    tail = block * copies + block[:cut % len(block)]
    loop = tail_loop(prefix + tail)
    long_enough = len(tail) >= max(MIN_TOKENS, MIN_REPEATS * period) and period <= MAX_PERIOD
    if long_enough:
        assert loop is not None and loop.period == period and loop.tokens >= len(tail), loop
    if loop is not None:  # whatever it found is a periodic tail by the thresholds
        ids = prefix + tail
        assert loop.tokens >= max(MIN_TOKENS, MIN_REPEATS * loop.period)
        assert all(ids[-i] == ids[-i - loop.period]
                   for i in range(1, loop.tokens - loop.period + 1))


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 30), min_size=0, max_size=5000))
def test_text_that_does_not_repeat_itself_is_never_a_loop(ids):
    """Even a 31-token vocabulary, drawn at random, never repeats 128 tokens back to back."""
    assert tail_loop(ids) is None


def test_the_simulated_models_outputs_are_named_as_it_made_them():
    """3,000 prompts cut at 4,096, natural (the words and the byte-level tokenizer, up to
    16,384 tokens: long thinking is not a loop) or falling into a loop: no row misnamed."""
    wrong, looping = [], 0
    for i in range(3000):
        prompt = tokens.render_chat([{"role": "user", "content": f"Task {i}: case {i * 31}."}])
        plan = lengths.plan_response(prompt, True, loop_share=LOOP_SHARE)
        found = tail_loop(plan.layout.ids(0, 4096))
        looping += plan.layout.loop is not None
        if plan.layout.loop is None:
            natural = plan.layout.ids(0, 16384)
            if found or tail_loop(natural):
                wrong.append((i, "natural named looping", found))
        elif not found or found.period != plan.layout.loop[1]:
            wrong.append((i, plan.layout.loop, found))
    assert not wrong, wrong[:5]
    assert 0.08 < looping / 3000 < 0.12
    for i in range(50):
        prompt = tokens.render_chat([{"role": "user", "content": f"bytes {i}"}])
        plan = lengths.plan_response(prompt, True, byte_level=True, fixed_tokens=16384)
        assert tail_loop(plan.layout.ids(0, 16384)) is None, i


def test_a_job_names_its_looping_rows_and_the_gate_drops_them(cluster, tmp_path):
    c = cluster()
    start(c, sim_args=("--slots", "40", "--decode-tps", "20000",
                       "--loop-share", str(LOOP_SHARE)))
    rows = [{"id": f"q{i:04d}", "prompt": f"Task {i}: reason about case {i * 7919 % 997}."}
            for i in range(300)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    c.manage("enqueue", "--dataset", str(data), "--job", "loops", "--gpus", "2",
             "--max-output-tokens", "4096")
    c.wait_done("loops")
    plans = {r["id"]: lengths.chat_plan([{"role": "user", "content": r["prompt"]}], 4096,
                                        loop_share=LOOP_SHARE) for r in rows}
    looping = {i for i, p in plans.items() if p.loop}
    cut = {i for i, p in plans.items() if p.finish_reason == "length"}
    assert looping <= cut and len(looping) > 15 and len(cut - looping) > 15

    made = {row["id"]: row for row in c.rows("loops")}
    assert {i for i, row in made.items() if row["metadata"].get("loop")} == looping
    for i in looping:
        assert made[i]["metadata"]["loop"]["period"] == plans[i].loop[1]

    stats = json.loads(c.manage("stats", "--job", "loops", "--json", "--sample", "300").stdout)
    assert stats["truncated"] == {"rows": len(cut), "looping": len(looping),
                                  "progressing": len(cut - looping),
                                  "looping_mean_tokens": 4096}
    assert stats["sample"]["truncated_looping"]["count"] == len(looping)
    said = c.manage("stats", "--job", "loops").stdout
    assert f"{len(looping):,} looping" in said and f"{len(cut - looping):,} still progressing" in said
    status = c.status("loops")
    assert status["truncated"]["looping"] == len(looping)
    assert f"{len(looping):,} looping" in c.manage("status", "--job", "loops").stdout

    # Continued to 8,192: a loop stays a loop, the progressing rows finish or go on; the
    # counters follow the newest rows (reopen.lua takes the old row's mark back).
    c.manage("set", "--job", "loops", "--max-output-tokens", "8192")
    skipped = c.manage("regenerate", "--job", "loops", "--finish-reason", "length", "--continue",
                       "--skip-looping").stdout
    assert f"{len(cut - looping):,} prompts with finish_reason 'length' queued" in skipped
    c.wait_done("loops")
    assert c.status("loops")["truncated"]["looping"] == len(looping)  # left as they were
    assert all(row["metadata"]["completion_tokens"] == 4096
               for row in c.rows("loops") if row["id"] in looping)
    c.manage("regenerate", "--job", "loops", "--finish-reason", "length", "--continue")
    c.wait_done("loops")
    newest = {row["id"]: row for row in c.rows("loops")}
    still = {i for i, row in newest.items() if row["metadata"]["finish_reason"] == "length"}
    assert {i for i, row in newest.items() if row["metadata"].get("loop")} == looping
    assert looping <= still
    split = c.status("loops")["truncated"]
    assert split == {"rows": len(still), "looping": len(looping),
                     "progressing": len(still - looping), "looping_mean_tokens": 8192}

    # The gate drops them by default, and says how many; --keep-looping keeps them.
    report = json.loads(c.manage("validate", "--job", "loops", "--json", "--max-length",
                                 "16384", "--keep-truncated", check=False).stdout)
    assert report["looping"] == len(looping)
    assert report["dropped"]["looping"] == len(looping)
    kept = json.loads(c.manage("validate", "--job", "loops", "--json", "--max-length", "16384",
                               "--keep-truncated", "--keep-looping", check=False).stdout)
    assert "looping" not in kept["dropped"] and kept["kept"] == report["kept"] + len(looping)
    table = c.manage("validate", "--job", "loops", "--max-length", "16384", check=False).stdout
    assert f"{len(looping):,} rows end in a repetition loop" in table
