"""SpecForge 0.2.0 as the oracle of the hand-off (installed by `make install`, its own code run
on CPU): what the default path gives it, read by its own loader, is exactly the project's
input_ids and loss_mask; the conversations path differs by exactly the differences
docs/TRAINING_DATA.md names; the run config the command trainer writes is accepted by its own
config loader with the values from [command]."""
from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path

import pytest

# Installed by `make install` (requirements-specforge.txt): a missing SpecForge fails here.
import specforge.config as specforge_config  # noqa: E402
from specforge.data.prompt_builder import prepare_prompt_tasks  # noqa: E402
from test_training_data import generate_rows, sim_rows, sim_url, words, write_batches  # noqa: F401
from tokenizer_support import build_tokenizer

from dflash_dev.sim import tokens as sim
from dflash_tasks.core.jobs import GenerationParams
from dflash_tasks.output.storage import LocalStorage
from dflash_tasks.training.data.exports import export_training
from dflash_tasks.training.data.gate import Rules
from dflash_tasks.training.data.tokens import ChatTemplate, tokenize_row
from dflash_tasks.training.queue import spec
from dflash_tasks.training.queue.specforge import (
    HandoffError,
    export_rules,
    run_config,
    template_for,
    write,
)

# A single turn and a multi-turn prompt on which the simulated model answers in both modes
# without running past the cap: in CONVERSATIONS it gives the single turn no answer without
# thinking (dropped as empty) and never finishes the multi-turn one with thinking.
MORE = {"single_b": [{"role": "user", "content": words(14, 10)}],
        "multi_b": [{"role": "user", "content": words(14, 6)},
                    {"role": "assistant", "content": words(15, 5),
                     "reasoning_content": words(16, 3)},
                    {"role": "user", "content": words(17, 7)}]}
SHAPES = ("single", "system", "multi", "multi_system")

ALL = Rules(min_loss_tokens=0, max_length=1 << 20, keep_truncated=True)
# SpecForge's Qwen templates put this system turn into a conversation that has none.
INJECTED_SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"), words=("You", "are", "a",
                                                                          "helpful", "assistant."))


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)


@pytest.fixture(scope="module")
def shaped_rows(sim_rows, sim_url) -> list[dict]:  # noqa: F811
    """Every shape: single turn, system + user, multi-turn (with and without a system turn),
    thinking on and off, finished and truncated."""
    return sim_rows + generate_rows(sim_url, MORE)


def shape(row_id: str) -> str:
    return row_id.removeprefix("bare-").split("-")[0].removesuffix("_b")


@pytest.fixture(scope="module")
def rows(shaped_rows) -> list[dict]:
    """Every shape, and each again without the server's ids, so that the project tokenizes it
    through --tokenizer."""
    bare = [{**{k: v for k, v in r.items() if k != "token_ids"}, "id": "bare-" + r["id"]}
            for r in shaped_rows]
    return shaped_rows + bare


def read_prompts(path: Path, tokenizer=None, **kwargs) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of every sample, as SpecForge's own prompt loader prepares them for
    its trainer (specforge.data.prompt_builder.prepare_prompt_tasks, what data.prompts_path and
    data.train_data_path go through)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tasks = prepare_prompt_tasks(path, tokenizer, max_length=1 << 20, is_preformatted=False,
                                     cache_dir=None, cache_key=None, num_proc=None,
                                     min_loss_tokens=0, **kwargs)
        return [(t["payload"]["input_ids"], t["payload"]["loss_mask"]) for t in tasks]


def exported(tmp_path: Path, rows: list[dict], fmt: str, template=None, job="sf"):
    write_batches(tmp_path / "shipped", job, rows, per_batch=7)
    out = export_training(LocalStorage(tmp_path / "shipped"), job, fmt, tmp_path / fmt, ALL,
                          template=template)
    ids = [json.loads(line)["id"] for line in out.path.read_text().splitlines()]
    return out, ids


def test_the_oracle_is_the_pinned_specforge():
    from importlib.metadata import version

    pinned = [line.split("==")[1].strip() for line in
              (Path(__file__).parent.parent / "requirements-specforge.txt").read_text().splitlines()
              if line.startswith("specforge==")]
    assert pinned == ["0.2.0"] and version("specforge") == "0.2.0"


def test_the_default_path_hands_specforge_exactly_the_projects_ids_and_mask(
        tmp_path, rows, tokenizer_dir):
    template = ChatTemplate.load(tokenizer_dir)
    out, ids = exported(tmp_path, rows, "specforge-tokenized", template=template)
    assert len(rows) == 72 and out.kept == 66  # the simulator's empty answers are dropped
    assert set(out.report.dropped) == {"empty_answer"}
    by_id = {r["id"]: r for r in rows}

    # The run config the command trainer writes points SpecForge's loader at that file ...
    config = write(run_config({**spec.COMMAND_DEFAULTS, "target_model": "/models/Qwen3-8B", "max_length": 8192},
                              fmt="specforge-tokenized", data_path=out.path,
                              output_dir=tmp_path / "ckpt", work_dir=tmp_path / "sf",
                              run_id="r-a1"), tmp_path / "specforge.json")
    cfg = specforge_config.load_config(str(config))
    assert cfg.data.prompts_path == str(out.path) and not cfg.data.train_data_path

    # ... which returns, sample by sample, what the project computed: from the server's ids, or
    # through the target tokenizer's own template for rows without them.
    samples = read_prompts(Path(cfg.data.prompts_path), chat_template=cfg.data.chat_template,
                           train_only_last_turn=cfg.data.train_only_last_turn)
    assert len(samples) == len(ids)
    sources = set()
    for rid, (input_ids, loss_mask) in zip(ids, samples):
        ours = tokenize_row(by_id[rid], template)
        sources.add(ours.source)
        assert input_ids == ours.input_ids, rid
        assert loss_mask == ours.loss_mask, rid
    assert sources == {"server", "template"}
    # Every shape reached SpecForge: single turn, system + user, multi-turn (with and without a
    # system turn), in both thinking modes, finished and truncated, from the server's ids and
    # through the tokenizer.
    shapes = {(shape(rid), by_id[rid]["metadata"]["enable_thinking"], by_id[rid]["status"],
               rid.startswith("bare-")) for rid in ids}
    assert shapes == {(s, thinking, status, bare) for s in SHAPES for thinking in (True, False)
                      for status in ("success", "truncated") for bare in (True, False)}


def named_differences(row: dict, ours, encode) -> tuple[list[int], list[int]]:
    """The project's sample with exactly the differences docs/TRAINING_DATA.md names for
    SpecForge's own rendering (qwen3-thinking / qwen3-instruct, train_only_last_turn):
    1. the system turn SpecForge adds to a conversation without one (mask 0);
    2. a truncated row closed as if finished: `</think>` when the cut struck inside the
       reasoning, then `<|im_end|>`, both under the loss."""
    ids, mask = list(ours.input_ids), list(ours.loss_mask)
    if row["conversations"][0]["role"] != "system":
        system = encode(INJECTED_SYSTEM)
        ids, mask = system + ids, [0] * len(system) + mask
    if row["status"] == "truncated":
        closing = [sim.IM_END]
        if row["metadata"]["enable_thinking"] and sim.END_THINK not in ids[-ours.loss_tokens:]:
            closing = [sim.END_THINK, sim.IM_END]
        ids, mask = ids + closing, mask + [1] * len(closing)
    return ids, mask


@pytest.mark.parametrize("thinking", [True, False])
def test_the_conversations_path_differs_by_exactly_the_named_differences(
        tmp_path, shaped_rows, hf_tokenizer, thinking):
    rows = [r for r in shaped_rows if r["metadata"]["enable_thinking"] is thinking]
    out, ids = exported(tmp_path, rows, "specforge-conversations")
    by_id = {r["id"]: r for r in rows}
    assert {(shape(i), by_id[i]["status"]) for i in ids} == \
        {(s, status) for s in SHAPES for status in ("success", "truncated")}
    chat_template = template_for("auto", dict(out.thinking))
    assert chat_template == ("qwen3-thinking" if thinking else "qwen3-instruct")
    config = run_config({**spec.COMMAND_DEFAULTS, "target_model": "/m", "max_length": 8192},
                        fmt="specforge-conversations", data_path=out.path,
                        output_dir=tmp_path / "c", work_dir=tmp_path / "w", run_id="r",
                        chat_template=chat_template)
    cfg = specforge_config.Config.model_validate(config)
    assert cfg.data.train_only_last_turn is True and cfg.data.chat_template == chat_template

    samples = read_prompts(out.path, hf_tokenizer, chat_template=cfg.data.chat_template,
                           train_only_last_turn=cfg.data.train_only_last_turn)
    # SpecForge shuffles the rows (datasets' shuffle, seed 42): the same permutation of indices.
    from datasets import Dataset

    order = Dataset.from_dict({"i": list(range(len(ids)))}).shuffle(seed=42)["i"]
    encode = lambda text: hf_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    exact = 0
    for index, (input_ids, loss_mask) in zip(order, samples):
        row = by_id[ids[index]]
        ours = tokenize_row(row)
        want_ids, want_mask = named_differences(row, ours, encode)
        assert input_ids == want_ids, row["id"]
        assert loss_mask == want_mask, row["id"]
        exact += (input_ids, loss_mask) == (ours.input_ids, ours.loss_mask)
    # Only finished rows that have a system turn come through unchanged.
    assert exact == sum(r["status"] == "success" and r["conversations"][0]["role"] == "system"
                        for r in rows) > 0

    # What the refused choices would do, on the same file:
    wrong = read_prompts(out.path, hf_tokenizer, chat_template="qwen", train_only_last_turn=True)
    if thinking:  # qwen's GeneralParser drops reasoning_content: an empty think block instead
        for input_ids, loss_mask in wrong:
            at = input_ids.index(sim.THINK, len(input_ids) - sum(loss_mask))
            assert input_ids[at + 1] == sim.END_THINK and loss_mask[at:at + 2] == [1, 1]
        with pytest.raises(HandoffError, match="reasoning_content is dropped"):
            template_for("qwen", dict(out.thinking))
    else:  # qwen has no ignore_token: the prompt's empty think block is trained on
        assert all(sum(m) == sum(want) + 2 for (_, m), (_, want) in zip(wrong, samples))
        with pytest.raises(HandoffError, match="loss mask 1"):
            template_for("qwen", dict(out.thinking))
    # Without train_only_last_turn the dataset's earlier assistant turns would be trained on.
    every_turn = read_prompts(out.path, hf_tokenizer, chat_template=chat_template,
                              train_only_last_turn=False)
    multi = [k for k, i in enumerate(order) if ids[i].startswith("multi")]
    assert multi and all(sum(every_turn[k][1]) > sum(samples[k][1]) for k in multi)


def test_a_job_that_mixes_thinking_modes_is_refused_for_conversations():
    with pytest.raises(HandoffError,
                       match=r"mixes thinking modes \(3 rows with thinking, 2 without\)"):
        template_for("auto", {True: 3, False: 2})
    with pytest.raises(HandoffError, match="qwen3-instruct.*drops reasoning_content"):
        template_for("qwen3-instruct", {True: 3})
    assert template_for(None, {False: 1}) == "qwen3-instruct"


def test_the_run_config_is_accepted_by_specforges_loader_with_the_command_values(tmp_path):
    command = {"target_model": "/models/Qwen3-8B", "nproc": 2, "learning_rate": 3e-4,
               "epochs": 2, "block_size": 8, "drafter_layers": 3, "anchors_per_sequence": 256,
               "decay_gamma": 5.0, "max_length": 8192, "checkpoint_every": 500,
               "specforge": {"training": {"batch_size": 4}, "tracking": {"report_to": "none"}}}
    checked = spec.build({"gate": {}, "reference": {}, "command": command}, "command", None)
    assert checked["command"]["template"] == "specforge"  # a name: the node holds the line
    assert spec.BUILTIN_TEMPLATES["specforge"] == "specforge train --config {config_path}"
    values = checked["command"]["values"]
    path = write(run_config(values, fmt=values["format"], data_path=tmp_path / "tokenized.jsonl",
                            output_dir=tmp_path / "checkpoints", work_dir=tmp_path / "specforge",
                            run_id="job-train-1-a1"), tmp_path / "specforge.json")
    cfg = specforge_config.load_config(str(path))
    assert cfg.data.prompts_path == str(tmp_path / "tokenized.jsonl")
    assert (cfg.model.target_model_path, cfg.model.draft_block_size,
            cfg.model.draft_num_hidden_layers) == ("/models/Qwen3-8B", 8, 3)
    t = cfg.training
    assert (t.strategy, t.learning_rate, t.num_epochs, t.num_anchors, t.loss_decay_gamma,
            t.save_interval, t.batch_size) == ("dflash", 3e-4, 2, 256, 5.0, 500, 4)
    assert cfg.data.max_length == 8192 and cfg.output_dir == str(tmp_path / "checkpoints")
    assert cfg.data.cache_dir.startswith(str(tmp_path / "specforge"))  # under the run, not ./cache
    local = cfg.deployment.disaggregated.managed_local
    assert cfg.deployment.trainer.nproc_per_node == 2
    assert local.trainer_cuda_visible_devices == ["1", "2"]
    assert local.capture_servers[0].cuda_visible_devices == ["0"]
    # Capture servers started elsewhere, and a warm start on a later attempt.
    external = run_config({**values, "server_urls": ["http://gpu0:30000"]},
                          fmt="specforge-tokenized", data_path="d", output_dir="o",
                          work_dir="w", run_id="r-a2", warm_start=tmp_path / "r-a1-step500")
    cfg = specforge_config.Config.model_validate(external)
    assert cfg.deployment.disaggregated.server_urls == ["http://gpu0:30000"]
    assert cfg.deployment.disaggregated.managed_local is None
    assert cfg.model.draft_checkpoint_path == str(tmp_path / "r-a1-step500")


def test_train_refuses_a_command_section_specforge_would_refuse():
    def build(command: dict) -> dict:
        return spec.build({"gate": {}, "reference": {}, "command": command}, "command", None,
                          "train.toml")

    with pytest.raises(spec.SpecError, match="target_model: required"):
        build({})
    with pytest.raises(spec.SpecError, match=r"training\.batch_size"):
        build({"target_model": "/m", "specforge": {"training": {"batch_size": 0}}})
    with pytest.raises(spec.SpecError, match="trainer_cuda_visible_devices count must equal"):
        build({"target_model": "/m", "nproc": 2, "trainer_gpus": ["1"]})
    with pytest.raises(spec.SpecError, match="chat_template 'qwen' refused"):
        build({"target_model": "/m", "format": "specforge-conversations", "chat_template": "qwen"})
    assert build({"target_model": "/m", "format": "specforge-conversations"})


def test_a_conversations_run_leaves_truncated_rows_out_unless_asked(tmp_path, shaped_rows):
    """SpecForge would close a truncated row with an end of turn (and a `</think>`) the model
    never generated: the run's conversations export leaves them out even when [gate] keeps
    them, unless [command] keep_truncated = true. The tokenized export keeps the gate's rule."""
    rows = [r for r in shaped_rows if r["metadata"]["enable_thinking"]]
    truncated = {r["id"] for r in rows if r["status"] == "truncated"}
    gate = Rules(min_loss_tokens=0, max_length=1 << 20, keep_truncated=True)
    write_batches(tmp_path / "shipped", "sf", rows, per_batch=5)

    def kept(fmt: str, values: dict, name: str) -> set[str]:
        out = export_training(LocalStorage(tmp_path / "shipped"), "sf", fmt, tmp_path / name,
                              export_rules(gate, fmt, values))
        return {json.loads(line)["id"] for line in out.path.read_text().splitlines()}

    default = kept("specforge-conversations", dict(spec.COMMAND_DEFAULTS), "default")
    assert default and not default & truncated
    dropped = [json.loads(x) for x in (tmp_path / "default" / "conversations.dropped.jsonl").read_text().splitlines()]
    assert {d["id"] for d in dropped if d["reason"] == "truncated"} == truncated
    asked = kept("specforge-conversations", {"keep_truncated": True}, "asked")
    assert asked & truncated and default < asked
    assert kept("specforge-tokenized", {}, "tokenized") & truncated

    with pytest.raises(HandoffError, match="keep_truncated: true or false, not 'yes'"):
        export_rules(gate, "specforge-conversations", {"keep_truncated": "yes"})
    with pytest.raises(spec.SpecError, match="keep_truncated: true or false, not 'false'"):
        spec.build({"gate": {}, "reference": {},
                    "command": {"target_model": "/m", "keep_truncated": "false"}}, "command", None)


def conversation_rows(url: str) -> list[dict]:
    """Conversations whose every reply the simulated target made, as the pipeline makes them
    (enqueue --turns all: generate.py's turn records and row), in both thinking modes, with and
    without a system turn, finished and with a reply cut at the cap (which ends the
    conversation)."""
    from dflash_tasks.core import conversation
    from dflash_tasks.output.rows import build_conversation_row, turn_record
    from dflash_tasks.sglang.client import SGLangClient

    client = SGLangClient(url)
    rows = []
    try:
        for system in (False, True):
            for thinking in (True, False):
                for cap in (30000, 40):
                    script = [{"role": "system", "content": words(30, 4)}] if system else []
                    for t in range(3):
                        script += [conversation.SLOT] if t else []
                        script.append({"role": "user", "content": words(31 + t, 6)})
                    turns, last = [], None
                    params = GenerationParams(max_tokens=cap, enable_thinking=thinking)
                    while len(turns) < conversation.replies(script):
                        context = conversation.context(script, [t["content"] for t in turns])
                        last = client.chat(context, max_tokens=cap, enable_thinking=thinking)
                        turns.append(turn_record(last, gpu="gpu0@t", attempts=1))
                        if last.finish_reason != "stop":
                            break
                    rows.append(build_conversation_row(
                        f"conv-{system}-{thinking}-{cap}", script, turns, last=last, job="t",
                        gpu="gpu0@t", params=params, server=client.contract()))
    finally:
        client.close()
    return rows


def test_every_reply_of_a_conversation_reaches_specforge_once_in_its_own_context(
        tmp_path, sim_url, hf_tokenizer):  # noqa: F811
    """Issue 39: a conversation's every reply is one SpecForge sample, ending at it, the earlier
    replies' reasoning dropped (expand_reasoning_conversations.py's view): through the tokenized
    path exactly the server's ids of that reply's request, its response alone under the loss;
    through the conversations path the same, up to the differences docs/TRAINING_DATA.md names."""
    from dflash_tasks.core.conversation import reply_rows

    rows = conversation_rows(sim_url)
    views = {v["id"]: v for row in rows for v in reply_rows(row)}
    replies = sum(len(r["metadata"]["turns"]) for r in rows)
    assert len(views) == replies > len(rows)
    assert any(r["status"] == "truncated" and len(r["metadata"]["turns"]) < 3 for r in rows)

    out, ids = exported(tmp_path, rows, "specforge-tokenized")
    assert sorted(ids) == sorted(views)
    samples = read_prompts(out.path, chat_template="qwen3-thinking", train_only_last_turn=True)
    for rid, (input_ids, loss_mask) in zip(ids, samples):
        made = views[rid]["token_ids"]
        assert input_ids == made["prompt"] + made["response"], rid
        assert loss_mask == [0] * len(made["prompt"]) + [1] * len(made["response"]), rid
    # Each reply's tokens are under the loss exactly once in its conversation's samples.
    trained = Counter((rid.rpartition("/turn")[0], tuple(input_ids[-sum(mask):]))
                      for rid, (input_ids, mask) in zip(ids, samples) if sum(mask))
    for row in rows:
        for turn in [*row["token_ids"]["earlier_turns"], row["token_ids"]]:
            assert trained[(row["id"], tuple(turn["response"]))] == 1

    encode = lambda text: hf_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    for thinking in (True, False):
        chosen = [r for r in rows if r["metadata"]["enable_thinking"] is thinking]
        out, ids = exported(tmp_path / str(thinking), chosen, "specforge-conversations")
        template = template_for("auto", dict(out.thinking))
        samples = read_prompts(out.path, hf_tokenizer, chat_template=template,
                               train_only_last_turn=True)
        from datasets import Dataset

        order = Dataset.from_dict({"i": list(range(len(ids)))}).shuffle(seed=42)["i"]
        for index, (input_ids, loss_mask) in zip(order, samples):
            view = views[ids[index]]
            want_ids, want_mask = named_differences(view, tokenize_row(view), encode)
            assert input_ids == want_ids, view["id"]
            assert loss_mask == want_mask, view["id"]
