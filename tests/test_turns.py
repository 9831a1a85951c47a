"""Every assistant turn regenerated in context (issue 39, item 1): with `enqueue --turns all`, a
conversation's replies are generated one after another, each after the target's own earlier
replies as the chat template renders them (their visible content, not their reasoning). The
simulated server's output is a function of the prompt ids it rendered (dflash_dev/sim), so a
reply made in any other context (the dataset's own earlier answers, a reasoning left in, a turn
skipped or doubled) has other ids: each turn is checked against what the server gives for the
context the row says it was generated in, and that context against the template's rendering of
the row's own earlier replies."""
from __future__ import annotations

import json
import time
from collections import Counter

from conftest import Cluster, write_jsonl
from failure_support import check_books, counters, sim_hold, sim_release, sim_stats
from support import wait_until

from dflash_dev.sim import lengths, tokens
from dflash_tasks.core import conversation

MEDIAN, P_OVER = 300.0, 0.01
SIM = ("--slots", "24", "--decode-tps", "4000", "--median-tokens", str(MEDIAN),
       "--p-over-4096", str(P_OVER))
CAP = 4096
TURNS = 5


def conversations(n: int, turns: int = TURNS) -> list[dict]:
    """ShareGPT-style conversations of `turns` user turns, each answered by "another model"."""
    out = []
    for i in range(n):
        conv = [{"from": "system", "value": f"You are assistant number {i % 3}."}]
        for t in range(turns):
            conv.append({"from": "human", "value": f"Conversation {i}, question {t}: what of {i * 31 + t}?"})
            conv.append({"from": "gpt", "value": f"Another model's answer {t} to {i}."})
        out.append({"id": f"c{i:03d}", "conversations": conv})
    return out


def expected_ids(prompt_ids: list[int], n: int) -> list[int]:
    """What the simulated server generates after these prompt ids: its first n tokens."""
    plan = lengths.plan_response(prompt_ids, True, median=MEDIAN, p_over_4096=P_OVER)
    return plan.layout.ids(0, n)


def check_turns(row: dict, source: dict) -> int:
    """Every reply of the row made by the target after its own earlier replies; returns them."""
    meta, ids = row["metadata"], row["token_ids"]
    turns = meta["turns"]
    per_turn = [*ids["earlier_turns"], {"prompt": ids["prompt"], "response": ids["response"]}]
    assert len(per_turn) == len(turns) == len(meta["finish_reasons"])
    replies = [m for m in row["conversations"] if m["role"] == "assistant"]
    assert len(replies) == len(turns)
    users = [m["value"] for m in source["conversations"] if m["from"] == "human"]
    asked = [m["content"] for m in row["conversations"] if m["role"] == "user"]
    assert asked == users[:len(turns)]
    script = [{"role": "system", "content": source["conversations"][0]["value"]}]
    for t, user in enumerate(users):
        script += [conversation.SLOT] if t else []
        script.append({"role": "user", "content": user})
    for k, (turn, made) in enumerate(zip(turns, per_turn)):
        history = conversation.context(script, [r["content"] for r in replies[:k]])
        # The context as the template renders it: earlier replies' content, never the dataset's
        # answers and never their reasoning.
        assert made["prompt"] == tokens.render_chat(history), (row["id"], k)
        assert made["response"] == expected_ids(made["prompt"], len(made["response"])), (row["id"], k)
        assert turn["completion_tokens"] == len(made["response"])
        assert not any("Another model" in (r["content"] or "") for r in replies)
        if turn["finish_reason"] == "stop":
            assert replies[k]["reasoning_content"] and replies[k]["content"]
    assert meta["completion_tokens"] == sum(len(t["response"]) for t in per_turn)
    assert meta["prompt_tokens"] == sum(len(t["prompt"]) for t in per_turn)
    ended_early = meta["finish_reasons"][-1] == "length"
    assert all(f == "stop" for f in meta["finish_reasons"][:-1])
    assert len(turns) == TURNS or ended_early
    assert row["status"] == ("truncated" if ended_early else "success")
    return len(turns)


def test_every_turn_of_five_turn_conversations_is_the_targets_in_its_own_context(cluster, tmp_path):
    c = cluster()
    for gpu in (0, 1):
        c.start_server(gpu, *SIM)
        c.start_worker(gpu)
    c.start_beat()
    data = conversations(60)
    path = write_jsonl(tmp_path / "chats.jsonl", data)
    out = c.manage("enqueue", "--dataset", str(path), "--job", "chat", "--turns", "all",
                   "--max-output-tokens", str(CAP))
    assert "every assistant reply" in out.stdout
    c.wait_done("chat", timeout=600)
    rows = check_books(c, "chat", {d["id"] for d in data})
    source = {d["id"]: d for d in data}
    made = Counter(check_turns(row, source[row["id"]]) for row in rows)
    assert made[TURNS] >= 50  # the others ended early, on a reply cut at the cap
    replies = sum(n * k for n, k in made.items())
    books = counters(c, "chat")
    assert books["turns"] == replies - 60
    # Some replies ran past a round of the end game (this small job is in rounds from its
    # start: the sim's lengths are fixed by the context) and went on from their ids, in turn.
    assert books["rounds"] > 0
    assert c.status("chat")["turns"] == {"replies": replies, "handed_on": replies - 60}
    # Training reads one row per reply, ending at it, in the context it was generated in: its
    # request's prompt ids, its response alone under the loss (tests/test_specforge.py hands the
    # same to SpecForge).
    c.manage("export", "--job", "chat", "--to", str(tmp_path / "tok"), "--format",
             "specforge-tokenized", "--keep-truncated")
    samples = [json.loads(line) for line in (tmp_path / "tok" / "tokenized.jsonl").open()]
    by_row = {r["id"]: r for r in rows}
    report = json.loads((tmp_path / "tok" / "tokenized.export_report.json").read_text())
    assert report["unique_ids"] == replies and report["kept"] == len(samples) > replies * 0.9
    for sample in samples:
        row_id, _, k = sample["id"].rpartition("/turn")
        ids = by_row[row_id]["token_ids"]
        made = [*ids["earlier_turns"], ids][int(k) - 1]
        assert sample["input_ids"] == made["prompt"] + made["response"]
        assert sample["loss_mask"] == [0] * len(made["prompt"]) + [1] * len(made["response"])
    # A resume keeps the job's --turns; another needs a new job.
    other = c.manage("enqueue", "--dataset", str(path), "--job", "chat", "--turns", "last", check=False)
    assert other.returncode != 0 and "needs a new job" in other.stderr


def test_a_turn_cut_at_the_cap_ends_its_conversation(cluster, tmp_path):
    c = cluster()
    c.start_server(0, *SIM)
    c.start_worker(0)
    c.start_beat()
    data = conversations(30)
    path = write_jsonl(tmp_path / "chats.jsonl", data)
    c.manage("enqueue", "--dataset", str(path), "--job", "cut", "--turns", "all",
             "--max-output-tokens", "300")
    c.wait_done("cut", timeout=600)
    rows = check_books(c, "cut", {d["id"] for d in data})
    source = {d["id"]: d for d in data}
    for row in rows:
        n = check_turns(row, source[row["id"]])
        if row["status"] == "truncated":
            # What it left unanswered is kept, for a regenerate to go on with.
            assert len([m for m in row["metadata"].get("unanswered", []) if m["role"] == "user"]) \
                == TURNS - n
    cut = [r for r in rows if r["status"] == "truncated"]
    assert cut and any(len(r["metadata"]["turns"]) < TURNS for r in cut)
    stats = json.loads(c.manage("stats", "--job", "cut", "--json").stdout)
    assert stats["turns"]["ended_by_length"] == len(cut)

    # The cap raised, the conversations cut go on: the reply cut continues from its ids, and
    # the turns it left unanswered are generated after it, each in its context.
    c.manage("set", "--job", "cut", "--max-output-tokens", str(CAP))
    c.manage("regenerate", "--job", "cut", "--finish-reason", "length", "--continue")
    c.wait_done("cut", timeout=600)
    rows = c.rows("cut")
    newest = {r["id"]: r for r in rows}  # batches in order: the newest row of each id last
    assert len(newest) == 30
    for row in newest.values():
        check_turns(row, source[row["id"]])
    for old in cut:
        new, k = newest[old["id"]], len(old["metadata"]["turns"]) - 1
        before, after = old["token_ids"], new["token_ids"]
        # Its earlier replies kept as they were, the one cut gone on from its own ids
        assert after["earlier_turns"][:k] == before["earlier_turns"]
        went_on = [*after["earlier_turns"], after][k]["response"]
        assert went_on[:len(before["response"])] == before["response"]
        assert len(went_on) > len(before["response"])
    assert sum(len(newest[r["id"]]["metadata"]["turns"]) for r in cut) > \
        sum(len(r["metadata"]["turns"]) for r in cut)


def test_conversations_survive_a_worker_kill_and_a_redis_restart_mid_conversation(aof_redis, tmp_path):
    """With the deployed settings: conversations held mid-way (some replies made, the next in
    flight), a worker SIGKILLed and Redis (AOF, fsync every second) crashed and started again.
    Every conversation ends in one row whose every reply is the target's in its own context: no
    reply lost, none doubled, none made in a context it does not record."""
    c = Cluster(tmp_path, aof_redis.url)
    try:
        for gpu in (0, 1):
            c.start_server(gpu, *SIM)
        worker = c.start_worker(0)
        c.start_worker(1)
        c.start_beat()
        data = conversations(80)
        path = write_jsonl(tmp_path / "chats.jsonl", data)
        sim_hold(*c.server_urls, after=60)
        c.manage("enqueue", "--dataset", str(path), "--job", "hold", "--turns", "all",
                 "--max-output-tokens", str(CAP))
        # Conversations mid-way, their next replies in flight: 120 of the 400 replies given,
        # then every answer held, however fast the machine (a hold once 60 replies were seen
        # came after the last on CI's loaded machine).
        wait_until(lambda: all(sim_stats(url)["held"] for url in c.server_urls), timeout=300,
                   what="both servers holding their answers after 60 each")
        wait_until(lambda: counters(c, "hold").get("turns", 0) >= 40, timeout=60,
                   what="40 replies handed on to their next turn")
        assert c.status("hold")["in_flight"] > 0
        worker.kill()
        time.sleep(1.5)  # past appendfsync's second: what was handed on is on disk
        aof_redis.crash()
        aof_redis.start()
        c.start_worker(0)
        sim_release(*c.server_urls)
        c.wait_done("hold", timeout=900)
        rows = check_books(c, "hold", {d["id"] for d in data})
        source = {d["id"]: d for d in data}
        made = Counter(check_turns(row, source[row["id"]]) for row in rows)
        assert made[TURNS] >= 70  # the others ended early, on a reply cut at the cap
        # Each reply handed on once: none lost with the crash, none counted twice.
        assert counters(c, "hold")["turns"] == sum(n * k for n, k in made.items()) - 80
    finally:
        c.stop()
