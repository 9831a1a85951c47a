"""Training data: exact tokens and loss masks from both paths (the server's ids and the target
tokenizer's chat template) checked token by token on rows from the simulated server, the quality
gate rejecting the "6 tokens" dataset with a clear message, the export formats, and the
quality figures beat puts into progress.json while a run goes."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
import zstandard
from conftest import write_jsonl
from support import ROOT, Proc, free_port, python, wait_until
from tokenizer_support import QWEN3_STYLE_TEMPLATE, build_tokenizer

from dflash_dev.sim import tokens as sim
from dflash_tasks.core.jobs import GenerationParams
from dflash_tasks.output.rows import build_row
from dflash_tasks.sglang.client import SGLangClient
from dflash_tasks.training.data.exports import report_files
from dflash_tasks.training.data.gate import Report, Rules, Thresholds, check_row
from dflash_tasks.training.data.tokens import ChatTemplate, compare, from_server_ids, tokenize_row


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def template(tokenizer_dir) -> ChatTemplate:
    return ChatTemplate.load(tokenizer_dir)


def words(seed: int, n: int) -> str:
    return " ".join(f"w{(seed * 7919 + i * 104729) % sim.VOCAB}" for i in range(n))


CONVERSATIONS = {
    "single": [{"role": "user", "content": words(1, 12)}],
    "system": [{"role": "system", "content": words(2, 5)}, {"role": "user", "content": words(3, 9)}],
    # an earlier assistant turn whose reasoning the template (and so the server) leaves out
    "multi": [{"role": "user", "content": words(4, 6)},
              {"role": "assistant", "content": words(5, 7), "reasoning_content": words(6, 4)},
              {"role": "user", "content": words(7, 8)}],
    "multi_system": [{"role": "system", "content": words(8, 3)},
                     {"role": "user", "content": words(9, 5)},
                     {"role": "assistant", "content": words(10, 4)},
                     {"role": "user", "content": words(11, 6)}],
}


def generate_rows(url: str, conversations: dict[str, list[dict]] = CONVERSATIONS) -> list[dict]:
    """Rows as the pipeline builds them, from the simulated server, in both thinking modes, at
    a cap that lets them finish and at caps that cut them inside the reasoning and the answer."""
    client = SGLangClient(url)
    rows = []
    try:
        for name, messages in conversations.items():
            for thinking in (True, False):
                natural = client.chat(messages, max_tokens=30000, enable_thinking=thinking)
                for cap in (30000, 3, max(2, natural.completion_tokens - 2)):
                    params = GenerationParams(max_tokens=cap, enable_thinking=thinking)
                    c = client.chat(messages, max_tokens=cap, enable_thinking=thinking)
                    prompt = [{"role": m["role"], "content": m["content"]} for m in messages]
                    rows.append(build_row(f"{name}-{thinking}-{cap}", prompt, c, job="t", gpu=0,
                                          params=params, attempts=1, server=client.contract()))
    finally:
        client.close()
    return rows


@pytest.fixture(scope="module")
def sim_url(tmp_path_factory) -> str:
    """A simulated SGLang server's URL, for the module's tests."""
    port = free_port()
    log = tmp_path_factory.mktemp("sim") / "sim.log"
    proc = Proc(python("-m", "dflash_dev.sim", "--port", str(port), "--decode-tps", "200000",
                       "--median-tokens", "300"), log)
    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200,
                   timeout=30, what="the simulated server")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def sim_rows(sim_url) -> list[dict]:
    return generate_rows(sim_url)


def expected_mask(row: dict) -> list[int]:
    """The mask by the structure of a Qwen3 conversation, written out independently: 0 through
    the generation prompt (`<|im_start|>assistant`, plus the empty think block when thinking is
    off), 1 on every generated token through `<|im_end|>`."""
    prompt, response = row["token_ids"]["prompt"], row["token_ids"]["response"]
    ids = prompt + response
    assistant = sim.piece_id("assistant")
    start = max(i for i in range(len(prompt) - 1) if ids[i] == sim.IM_START and ids[i + 1] == assistant)
    end = start + 2 + (0 if row["metadata"]["enable_thinking"] else 2)
    return [0] * end + [1] * (len(ids) - end)


def test_server_ids_and_template_agree_token_by_token(sim_rows, template):
    assert len(sim_rows) == 24
    statuses = {r["status"] for r in sim_rows}
    assert statuses == {"success", "truncated"}
    checked = 0
    for row in sim_rows:
        server = from_server_ids(row)
        ids, mask = server.input_ids, server.loss_mask
        thinking = row["metadata"]["enable_thinking"]
        assert mask == expected_mask(row), row["id"]
        # the generation prompt is the prompt: think block of a non-thinking prompt masked out
        p = server.prompt_len
        if thinking:
            assert ids[p] == sim.THINK and mask[p] == 1  # the model wrote <think> itself
        else:
            assert ids[p - 2:p] == [sim.THINK, sim.END_THINK] and mask[p - 2:p] == [0, 0]
            assert sim.THINK not in ids[p:] and sim.END_THINK not in ids[p:]
        if row["status"] == "success":
            assert ids[-1] == sim.IM_END and mask[-1] == 1  # the end of turn is trained on
            assert sum(mask) == row["metadata"]["completion_tokens"]
        else:
            assert sim.IM_END not in ids[p:]  # truncated: no end of turn was generated
        # no system prompt the data never had
        first_system = row["conversations"][0]["role"] == "system"
        assert (ids[1] == sim.piece_id("system")) == first_system
        # earlier assistant turns: their content only, their reasoning dropped
        if row["id"].startswith("multi-"):
            earlier = row["conversations"][1]
            assert ids[:p] == sim.render_chat(row["conversations"][:-1], thinking)
            if earlier.get("reasoning_content"):
                for w in earlier["reasoning_content"].split():
                    assert int(w[1:]) not in ids[:p]

        rendered = template.tokenize(row)
        ambiguous = row["status"] == "truncated" and server.input_ids[-1] == sim.END_THINK
        if ambiguous:  # cut right after </think>: only the server's ids can say so
            continue
        assert rendered.input_ids == ids, row["id"]
        assert rendered.loss_mask == mask, row["id"]
        agreement = compare(row, template)
        assert agreement.prompt_equal and agreement.tokens_equal and agreement.mask_equal
        checked += 1
    assert checked >= 20


def test_template_path_alone_and_its_failures(sim_rows, template, tokenizer_dir, tmp_path):
    # A row without server ids is tokenized through the template, the same as with ids.
    row = next(r for r in sim_rows if r["id"] == "multi-True-30000")
    bare = {k: v for k, v in row.items() if k != "token_ids"}
    assert tokenize_row(bare, template).input_ids == from_server_ids(row).input_ids
    assert tokenize_row(bare, template).source == "template"
    with pytest.raises(ValueError, match="--tokenizer"):
        tokenize_row(bare, None)

    # A template that injects a system prompt the data never had: the prompt ids disagree.
    injected = tmp_path / "injected"
    build_tokenizer(injected)
    config = json.loads((injected / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{%- if messages[0].role != 'system' -%}"
                               "{{- '<|im_start|>system\\nw1 w2 w3<|im_end|>\\n' -}}{%- endif -%}"
                               + QWEN3_STYLE_TEMPLATE)
    (injected / "tokenizer_config.json").write_text(json.dumps(config))
    wrong = ChatTemplate.load(injected)
    assert not compare(row, wrong).prompt_equal
    report = Report(Rules())
    for r in sim_rows:
        report.add(check_row(r, from_server_ids(r), Rules()))
        a = compare(r, wrong)
        report.compared += 1
        report.prompt_mismatch += not a.prompt_equal
    assert any("template mismatch" in f for f in Thresholds(max_truncated_share=1).failures(report))


# -- the "6 tokens" dataset --------------------------------------------------------------------


def write_batches(root: Path, job: str, rows: list[dict], per_batch: int = 50) -> None:
    """Batches and a manifest in the shipped format (as batches.BatchWriter writes them)."""
    records = []
    for n, start in enumerate(range(0, len(rows), per_batch)):
        chunk = rows[start:start + per_batch]
        data = zstandard.ZstdCompressor(write_checksum=True).compress(
            b"\n".join(json.dumps(r).encode() for r in chunk) + b"\n")
        name = f"batch-{1700000000000 + n:013d}-0000"
        key = f"{job}/batches/{name}.jsonl.zst"
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
        records.append({"name": name, "key": key, "location": str(root / key), "rows": len(chunk),
                        "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    (root / job / "manifest.json").write_text(json.dumps(
        {"job": job, "batches": records, "rows": len(rows), "bytes": sum(r["bytes"] for r in records)}))


def six_token_row(i: int) -> dict:
    """What the worthless dataset held: a thinking-mode answer that is an empty think block and
    nothing else: <think> \\n\\n </think> \\n\\n <|im_end|> -- 6 tokens with Qwen3's tokenizer."""
    prompt = sim.render_chat([{"role": "user", "content": words(i, 20)}], True)
    response = [sim.THINK, 271, sim.END_THINK, 271, 198, sim.IM_END]
    return {"id": f"six{i:04d}", "conversations": [
        {"role": "user", "content": words(i, 20)},
        {"role": "assistant", "content": "", "reasoning_content": ""}],
        "status": "success",
        "metadata": {"finish_reason": "stop", "enable_thinking": True, "prompt_tokens": len(prompt),
                     "completion_tokens": 6, "completed_at": 1.0},
        "token_ids": {"prompt": prompt, "response": response}}


def good_row(i: int) -> dict:
    prompt = sim.render_chat([{"role": "user", "content": words(i, 20)}], True)
    n = 200 + 37 * (i % 50)
    reasoning = [int(w[1:]) for w in words(i + 1, n).split()]
    answer = [int(w[1:]) for w in words(i + 2, n // 3).split()]
    return {"id": f"good{i:04d}", "conversations": [
        {"role": "user", "content": words(i, 20)},
        {"role": "assistant", "content": words(i + 2, n // 3), "reasoning_content": words(i + 1, n)}],
        "status": "success",
        "metadata": {"finish_reason": "stop", "enable_thinking": True, "prompt_tokens": len(prompt),
                     "completion_tokens": n + n // 3 + 3, "completed_at": 1.0},
        "token_ids": {"prompt": prompt,
                      "response": [sim.THINK, *reasoning, sim.END_THINK, *answer, sim.IM_END]}}


def manage(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(python("manage.py", *args), cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_validate_rejects_the_six_token_dataset(tmp_path):
    rows = [six_token_row(i) if i % 100 < 87 else good_row(i) for i in range(400)]
    write_batches(tmp_path, "six", rows)
    result = manage("validate", "--job", "six", "--from", str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    err = result.stderr
    assert "job six FAILS the quality gate" in err
    assert "loss-mask spike: 87.0% of finished rows (348 of 400) have a loss mask of exactly 6 tokens" in " ".join(err.split())
    assert "empty answers" in err and "short rows" in err and "empty reasoning" in err
    assert "FAIL" in result.stdout and "most common" in result.stdout

    data = json.loads(manage("validate", "--job", "six", "--from", str(tmp_path), "--json").stdout)
    assert data["passed"] is False
    assert data["loss_tokens"]["most_common"] == 6 and data["loss_tokens"]["most_common_rows"] == 348

    # The same gate passes the good rows alone, and the limits are the caller's to set.
    write_batches(tmp_path, "good", [good_row(i) for i in range(100)])
    ok = manage("validate", "--job", "good", "--from", str(tmp_path))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "PASS" in ok.stdout
    strict = manage("validate", "--job", "good", "--from", str(tmp_path), "--min-loss-tokens", "2000")
    assert strict.returncode == 1 and "fewer than 2000 loss tokens" in " ".join(strict.stderr.split())

    # Duplicate ids: the newest row (later batch) wins, older copies are counted.
    older = [six_token_row(i) | {"id": f"good{i:04d}"} for i in range(5)]
    write_batches(tmp_path, "redo", older + [good_row(i) for i in range(60)], per_batch=5)
    data = json.loads(manage("validate", "--job", "redo", "--from", str(tmp_path), "--json").stdout)
    assert data["rows"] == 60 and data["duplicates"] == 5
    assert data["passed"] is True and data["loss_tokens"]["min"] > 6  # the six-token copies lost


# -- a run through the pipeline: progress.json, validate, export -------------------------------


def test_pipeline_rows_pass_validate_and_export_in_every_format(cluster, tmp_path, tokenizer_dir):
    c = cluster()
    c.start_server(0, "--slots", "40", "--decode-tps", "40000")
    c.start_worker(0)
    c.start_beat()
    prompts = [{"id": f"p{i:03d}", "prompt": words(i, 10)} for i in range(50)]
    prompts += [{"id": f"m{i:03d}", "messages": CONVERSATIONS["multi_system"]
                 if i % 2 else CONVERSATIONS["multi"]} for i in range(2)]
    path = write_jsonl(tmp_path / "prompts.jsonl", prompts)
    c.manage("enqueue", "--dataset", str(path), "--job", "td", "--gpus", "1",
             "--max-output-tokens", "4096")
    c.wait_done("td")
    progress = json.loads((c.output_dir / "td" / "progress.json").read_text())
    quality = progress["quality"]
    assert quality["sampled_rows"] > 0 and quality["ok"] is True, quality
    assert quality["empty_answer_pct"] == 0 and quality["think_marker_rows"] == 0

    # A training max length that holds the job's longest rows (the prompt plus the 4,096-token
    # cap): the trainer's default, 4096, is the training gate's when none is given.
    result = c.manage("validate", "--job", "td", "--tokenizer", str(tokenizer_dir), "--json",
                      "--max-length", "8192")
    report = json.loads(result.stdout)
    assert report["passed"] and report["rows"] == 52
    assert report["template_check"]["compared"] == 52
    assert report["template_check"]["prompt_mismatch"] == 0
    truncated = report["statuses"].get("truncated", 0)
    assert 0 < truncated < 52

    rows = {r["id"]: r for r in c.rows("td")}
    for fmt in ("specforge-conversations", "specforge-tokenized", "parquet"):
        dest = tmp_path / fmt
        out = c.manage("export", "--job", "td", "--format", fmt, "--to", str(dest)).stdout
        assert "dropped: truncated" in out
        report_name, dropped_name = report_files(fmt)
        summary = json.loads((dest / report_name).read_text())
        dropped = [json.loads(line) for line in (dest / dropped_name).read_text().splitlines()]
        assert summary["kept"] + len(dropped) == 52
        assert {d["id"] for d in dropped if d["reason"] == "truncated"} == \
            {i for i, r in rows.items() if r["status"] == "truncated"}
        if fmt == "specforge-conversations":
            lines = [json.loads(x) for x in (dest / "conversations.jsonl").read_text().splitlines()]
            assert all(set(x) == {"id", "conversations", "status"} for x in lines)
            assert all(x["status"] == "success" and x["conversations"][-1]["reasoning_content"]
                       for x in lines)
            assert len(lines) == summary["kept"]
        elif fmt == "specforge-tokenized":
            lines = [json.loads(x) for x in (dest / "tokenized.jsonl").read_text().splitlines()]
            for x in lines:
                ids = rows[x["id"]]["token_ids"]
                assert x["input_ids"] == ids["prompt"] + ids["response"]
                assert x["loss_mask"] == [0] * len(ids["prompt"]) + [1] * len(ids["response"])
        else:
            table = pq.read_table(dest / "train.parquet")
            assert table.num_rows == summary["kept"]
            first = table.slice(0, 1).to_pylist()[0]
            assert first["input_ids"][:len(rows[first["id"]]["token_ids"]["prompt"])] == \
                rows[first["id"]]["token_ids"]["prompt"]
            assert first["conversations"][-1]["role"] == "assistant"

    # --keep-truncated keeps them, and the default export (the batches) is unchanged.
    kept = c.manage("export", "--job", "td", "--format", "specforge-tokenized", "--keep-truncated",
                    "--min-loss-tokens", "0", "--to", str(tmp_path / "all"))
    assert json.loads((tmp_path / "all" / "tokenized.export_report.json").read_text())["kept"] == 52, \
        kept.stdout
    # Two formats into one directory: each keeps its own report and dropped ids.
    c.manage("export", "--job", "td", "--format", "specforge-conversations", "--to", str(tmp_path / "all"))
    assert json.loads((tmp_path / "all" / "tokenized.export_report.json").read_text())["kept"] == 52
    both = {fmt: json.loads((tmp_path / "all" / report_files(fmt)[0]).read_text())
            for fmt in ("specforge-tokenized", "specforge-conversations")}
    assert {fmt: r["format"] for fmt, r in both.items()} == {f: f for f in both}
    c.manage("export", "--job", "td", "--to", str(tmp_path / "raw"))
    assert (tmp_path / "raw" / "manifest.json").exists()
    # ... and what it downloaded can be checked where it lies, with no Redis and no S3.
    again = json.loads(c.manage("validate", "--job", "td", "--from", str(tmp_path / "raw"),
                                "--json", "--max-length", "8192").stdout)
    assert again["rows"] == 52 and again["passed"]


def test_a_bad_run_shows_in_progress_json_within_its_first_ticks(cluster, tmp_path):
    """Every response an empty think block and nothing else: progress.json says so while the
    job is still far from done."""
    c = cluster()
    c.start_server(0, "--slots", "8", "--decode-tps", "2", "--fixed-tokens", "4")
    c.start_worker(0)
    c.start_beat()
    path = write_jsonl(tmp_path / "prompts.jsonl",
                       [{"id": f"b{i:03d}", "prompt": words(i, 8)} for i in range(400)])
    c.manage("enqueue", "--dataset", str(path), "--job", "bad", "--gpus", "1")
    progress_file = c.output_dir / "bad" / "progress.json"

    def alerted():
        p = json.loads(progress_file.read_text())
        q = p.get("quality") or {}
        return q.get("window_rows", 0) >= 10 and not q["ok"] and p

    p = wait_until(alerted, timeout=120, interval=0.5, what="quality alerts in progress.json")
    assert p["completed"] < p["total"]  # visible while the run goes on
    q = p["quality"]
    assert q["most_common_loss_tokens"] == 4 and q["most_common_pct"] == 100.0
    alerts = " ".join(q["alerts"])
    assert "loss mask of exactly 4 tokens" in alerts and "empty answers" in alerts
    c.manage("cancel", "--job", "bad", "--yes")


def test_the_quality_window_restarts_when_regenerate_supersedes_rows(redis_url):
    """progress.json's quality.truncated_pct counted rows a regenerate had replaced (14% against
    the job's 3%): after a regenerate the window holds only rows made since, also when rows made
    before it were still waiting for their batch."""
    import redis

    from dflash_tasks.core.keys import JobName
    from dflash_tasks.training.data.monitor import restart_window, sample_quality

    r = redis.Redis.from_url(redis_url)

    def add(n: int, reason: str) -> list[tuple[str, dict]]:
        """n rows in the stream, as (stream id, row): what a sealed batch hands the monitor."""
        out = []
        for i in range(n):
            row = {"id": f"{reason}{i}", "status": "completed", "conversations": [],
                   "metadata": {"completion_tokens": 100, "prompt_tokens": 10, "finish_reason": reason}}
            out.append((r.xadd(JobName("qw").output, {"id": row["id"], "row": json.dumps(row)}).decode(), row))
        return out

    assert sample_quality(r, JobName("qw"), add(10, "length") + add(10, "stop"))["truncated_pct"] == 50.0
    unsealed = add(5, "length")  # made before the regenerate, not yet in a batch
    restart_window(r, JobName("qw"))  # the truncated rows are being generated again
    after = sample_quality(r, JobName("qw"), unsealed + add(10, "stop"))  # the batch that seals them
    assert after["window_rows"] == 10 and after["truncated_pct"] == 0.0
    assert after["sampled_rows"] == 30
    assert sample_quality(r, JobName("qw"), unsealed)["sampled_rows"] == 30  # a batch is sampled once
