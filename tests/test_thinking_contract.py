"""The thinking-mode contract and the run's row rules: every row records the server's chat
template fingerprint and reasoning parser (learnt from /server_info, real shapes); the gate
refuses rows that mix thinking modes, naming values, rows, batches and ids; an evaluation is held
to the run's mode by one function; a run whose rules keep no row is refused by the gate; and one
[rules] section makes the gate and the reference trainer keep exactly the same rows."""
from __future__ import annotations

import copy
import json

import httpx
import pytest
from support import Proc, free_port, python, wait_until
from test_training_data import generate_rows, good_row, manage, write_batches

from dflash_tasks.output.storage import LocalStorage
from dflash_tasks.sglang import SGLangClient
from dflash_tasks.training.data.exports import checked_rows, validate_job
from dflash_tasks.training.data.gate import Report, Rules, Thresholds
from dflash_tasks.training.data.thinking import (
    NOT_RECORDED,
    ThinkingMode,
    run_thinking_mode,
    thinking_mode_mismatch,
)
from dflash_tasks.training.queue import spec
from dflash_tasks.training.reference.config import TrainConfig
from dflash_tasks.training.reference.data import job_dataset

CONVERSATION = {"one": [{"role": "user", "content": "w11 w12 w13 w14 w15 w16"}]}


def start_sim(tmp_path, *args: str):
    port = free_port()
    proc = Proc(python("-m", "dflash_dev.sim", "--port", str(port), "--decode-tps", "200000",
                       "--median-tokens", "300", *args), tmp_path / f"sim{port}.log")
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(url + "/health").status_code == 200, timeout=30,
               what="the simulated server")
    return proc, url


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Three servers: the usual one, one launched with another --chat-template, one without a
    reasoning parser."""
    tmp = tmp_path_factory.mktemp("sims")
    started = [start_sim(tmp), start_sim(tmp, "--chat-template", "/templates/other.jinja"),
               start_sim(tmp, "--reasoning-parser", "none")]
    yield [url for _, url in started]
    for proc, _ in started:
        proc.stop()


def with_mode(row: dict, rid: str, **meta) -> dict:
    row = copy.deepcopy(row)
    row["id"] = rid
    row["metadata"].update(meta)
    return row


def recorded_row(i: int, **meta) -> dict:
    return with_mode(good_row(i), f"good{i:04d}", chat_template="sha256:aaaa",
                     reasoning_parser="qwen3", **meta)


def test_rows_record_the_servers_template_and_parser(servers):
    plain, other, no_parser = (generate_rows(url, CONVERSATION) for url in servers)
    info = httpx.get(servers[0] + "/server_info").json()
    assert (info["chat_template"], info["reasoning_parser"]) == (None, "qwen3")
    assert httpx.get(servers[2] + "/model_info").json()["reasoning_parser"] is None
    for rows in (plain, other, no_parser):
        assert {(r["metadata"]["chat_template"] or "").startswith("sha256:") for r in rows} == {True}
    fingerprint = {url: SGLangClient(url).contract().chat_template for url in servers}
    assert fingerprint[servers[0]] == fingerprint[servers[2]] != fingerprint[servers[1]]
    assert {r["metadata"]["chat_template"] for r in other} == {fingerprint[servers[1]]}
    assert {r["metadata"]["reasoning_parser"] for r in plain} == {"qwen3"}
    # without a parser the reasoning stays in content, as SGLang leaves it
    assert {r["metadata"]["reasoning_parser"] for r in no_parser} == {None}
    thinking = [r for r in no_parser if r["metadata"]["enable_thinking"] and r["status"] == "success"]
    assert thinking and all("<think>" in r["conversations"][-1]["content"] and
                            r["conversations"][-1]["reasoning_content"] is None for r in thinking)


def test_the_gate_refuses_rows_from_a_server_with_another_template(servers, tmp_path):
    def thinking(url: str) -> list[dict]:
        return [r for r in generate_rows(url, CONVERSATION) if r["metadata"]["enable_thinking"]]

    rows = thinking(servers[0]) + [with_mode(r, "odd-" + r["id"]) for r in thinking(servers[1])]
    write_batches(tmp_path, "mixed", rows, per_batch=3)
    odd = next(r["metadata"]["chat_template"] for r in rows if r["id"].startswith("odd-"))
    rules = Rules(min_loss_tokens=0, keep_truncated=True)
    report, failures = validate_job(LocalStorage(tmp_path), "mixed", rules, Thresholds(
        max_truncated_share=1, max_empty_answer_share=1, max_short_share=1, max_spike_share=1))
    [mixed] = [f for f in failures if f.startswith("thinking mode mixed")]
    assert "chat_template differs across the rows: " in mixed and f"{odd} in 3 rows" in mixed
    assert "batch-1700000000001-0000" in mixed and "odd-one-" in mixed
    assert report.figures()["thinking_mode"]["chat_template"] == NOT_RECORDED
    # the same rows with the odd ones left out pass, and the mode is the rows' one mode
    write_batches(tmp_path, "one", [r for r in rows if not r["id"].startswith("odd-")])
    report, failures = validate_job(LocalStorage(tmp_path), "one", rules, Thresholds(
        max_truncated_share=1, max_empty_answer_share=1, max_short_share=1, max_spike_share=1))
    assert not [f for f in failures if "thinking mode" in f]
    assert report.figures()["thinking_mode"]["reasoning_parser"] == "qwen3"


def test_mixed_thinking_is_refused_by_manage_validate_and_older_rows_are_accepted(tmp_path):
    rows = [recorded_row(i) for i in range(30)] + [
        recorded_row(i, enable_thinking=False) for i in range(30, 34)]
    write_batches(tmp_path, "flip", rows, per_batch=10)
    result = manage("validate", "--job", "flip", "--from", str(tmp_path))
    assert result.returncode == 1
    message = " ".join(result.stderr.split())
    assert "enable_thinking differs across the rows: True in 30 rows" in message
    assert "False in 4 rows (batches batch-1700000000003-0000" in message
    assert "ids good0033, good0032, good0031" in message
    # rows from before the record: accepted, and counted as such
    write_batches(tmp_path, "old", [good_row(i) for i in range(30)] + [recorded_row(i) for i in range(30, 40)])
    result = manage("validate", "--job", "old", "--from", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    mode = json.loads(result.stdout)["thinking_mode"]
    assert mode["unrecorded_rows"] == {"chat_template": 30, "reasoning_parser": 30}
    assert (mode["chat_template"], mode["reasoning_parser"]) == ("sha256:aaaa", "qwen3")


def test_one_function_holds_an_evaluation_to_the_runs_mode():
    rows = [recorded_row(i) for i in range(5)]
    assert thinking_mode_mismatch(rows, {"enable_thinking": True, "chat_template": "sha256:aaaa",
                                         "reasoning_parser": "qwen3"}) == []
    assert thinking_mode_mismatch(rows, {"enable_thinking": False}) == [
        "enable_thinking: the run's rows have True, this has False"]
    verdict = {"passed": True, "thinking_mode": {"enable_thinking": True,
                                                 "chat_template": "sha256:aaaa",
                                                 "reasoning_parser": "qwen3", "values": {},
                                                 "unrecorded_rows": {}}}
    assert thinking_mode_mismatch(verdict, ThinkingMode(True, "sha256:bbbb", None)) == [
        "chat_template: the run's rows have sha256:aaaa, this has sha256:bbbb",
        "reasoning_parser: the run's rows have qwen3, this has none"]
    with pytest.raises(ValueError, match="enable_thinking differs"):
        run_thinking_mode(rows + [recorded_row(9, enable_thinking=False)])
    with pytest.raises(ValueError, match="unknown field 'thinking'"):
        thinking_mode_mismatch(rows, {"thinking": True})


def all_truncated(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        row = recorded_row(i)
        row["status"], row["metadata"]["finish_reason"] = "truncated", "length"
        rows.append(row)
    return rows


def test_the_gate_refuses_a_run_whose_rules_keep_no_row(tmp_path):
    write_batches(tmp_path, "cut", all_truncated(12))
    loose = Thresholds(max_truncated_share=1.0)
    _, failures = validate_job(LocalStorage(tmp_path), "cut", Rules(), loose)
    assert failures == ["too few rows kept: the rules keep 0 of 12 rows (at least 1 needed); "
                        "dropped: truncated 12 (rules: min_loss_tokens 32, max_length none, "
                        "keep_truncated false)"]
    _, failures = validate_job(LocalStorage(tmp_path), "cut", Rules(keep_truncated=True), loose)
    assert failures == []
    _, failures = validate_job(LocalStorage(tmp_path), "cut", Rules(keep_truncated=True),
                               Thresholds(max_truncated_share=1.0, min_kept_rows=20))
    assert failures and failures[0].startswith("too few rows kept: the rules keep 12 of 12 rows "
                                                "(at least 20 needed)")
    result = manage("validate", "--job", "cut", "--from", str(tmp_path),
                    "--max-truncated-share", "1")
    assert result.returncode == 1 and "the rules keep 0 of 12 rows" in " ".join(result.stderr.split())


def test_one_rules_section_makes_gate_and_trainer_keep_the_same_rows(tmp_path):
    rows = [recorded_row(i) for i in range(8)] + all_truncated(6)[2:]
    for i, row in enumerate(rows[8:]):
        row["id"] = f"cut{i}"
    write_batches(tmp_path, "both", rows, per_batch=4)
    storage = LocalStorage(tmp_path)
    for keep in (True, False):
        config = {"rules": {"keep_truncated": keep, "max_length": 8192},
                  "gate": {"max_truncated_share": 1.0},
                  "reference": {"target_model": str(tmp_path / "no-model")}}
        run_spec = spec.build(config, "reference", None)
        report = Report(spec.run_rules(run_spec))
        gate_ids = {c.row["id"] for c in checked_rows(storage, "both", report) if c.reason is None}
        trainer = TrainConfig.model_validate(run_spec["reference"])
        trainer_ids = {s["id"] for s in job_dataset(trainer, "both", storage, None, follow=False)}
        assert gate_ids == trainer_ids
        assert any(i.startswith("cut") for i in gate_ids) is keep and len(gate_ids) >= 8
    # a config that says two things is refused before anything is queued
    with pytest.raises(spec.SpecError, match=r"\[rules\] keep_truncated = true, \[reference\] "
                                             r"keep_truncated = false disagree"):
        spec.build({"rules": {"keep_truncated": True}, "gate": {},
                    "reference": {"target_model": "/m", "keep_truncated": False}}, "reference", None)
    command = spec.build({"rules": {"keep_truncated": True, "max_length": 2048}, "gate": {},
                          "command": {"target_model": "/m"}}, "command", None)
    assert (command["command"]["values"]["keep_truncated"], command["command"]["values"]["max_length"]) \
        == (True, 2048) == (spec.run_rules(command).keep_truncated, spec.run_rules(command).max_length)
