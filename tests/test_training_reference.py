"""The reference DFlash trainer (dflash_tasks.training.reference) on a tiny random Qwen3, CPU only: the
blocks' attention mask, labels and weights against hand-built ones; the loss falling on rows
that are the target's own greedy continuations, and the drafter then predicting what the target
itself generates; resume giving the same losses as an uninterrupted run; config errors."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from test_training_data import write_batches
from tiny_target import build_tiny_target, one_torch_thread  # noqa: F401  (a fixture)

from dflash_dev.sim import tokens as sim
from dflash_tasks.training.reference import (
    TrainConfig,
    greedy_acceptance,
    load_config,
    load_drafter,
    train,
)
from dflash_tasks.training.reference.blocks import (
    IGNORE,
    block_attention_mask,
    block_loss,
    build_blocks,
    chunked_block_loss,
    decay_weights,
    sample_anchors,
)
from dflash_tasks.training.reference.checkpoints import read_spec
from dflash_tasks.training.reference.evaluate import greedy_continuation
from dflash_tasks.training.reference.model import Drafter
from dflash_tasks.training.reference.target import default_layer_ids, layer_ids, load_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")
JOB = "greedy"
BLOCK = 4
STEPS = 250


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(target_dir)


def row(i: int, prompt: list[int], response: list[int]) -> dict:
    """A row in the shipped format (server token ids, thinking mode, finished)."""
    return {"id": f"g{i:03d}", "conversations": [
        {"role": "user", "content": "w1 w2"},
        {"role": "assistant", "content": "w3", "reasoning_content": "w4"}],
        "status": "success",
        "metadata": {"finish_reason": "stop", "enable_thinking": True,
                     "prompt_tokens": len(prompt), "completion_tokens": len(response),
                     "completed_at": 1.0},
        "token_ids": {"prompt": prompt, "response": response}}


@pytest.fixture(scope="module")
def data(tmp_path_factory, target) -> tuple[Path, list[dict]]:
    """8 rows whose responses are the target's own greedy continuation of their prompts (after
    the <think> it opens with), of three lengths, shipped in three batches."""
    rng = random.Random(1)
    rows = []
    for i in range(8):
        words = " ".join(f"w{rng.randrange(sim.VOCAB)}" for _ in range(6))
        prompt = sim.render_chat([{"role": "user", "content": words}], True)
        cont = greedy_continuation(target, torch.tensor(prompt + [sim.THINK]), 32 + 4 * (i % 3))
        rows.append(row(i, prompt, [sim.THINK, *cont.tolist()]))
    root = tmp_path_factory.mktemp("data")
    write_batches(root, JOB, rows, per_batch=3)
    return root, rows


def config(target_dir: Path, **overrides) -> TrainConfig:
    return TrainConfig(**{
        "target_model": str(target_dir), "block_size": BLOCK, "anchors_per_sequence": 8,
        "drafter_layers": 1,  # the mechanics, on one layer (the default is z-lab's five)
        "decay_gamma": 4.0, "learning_rate": 1e-2, "batch_size": 2, "shuffle_buffer": 4,
        "min_loss_tokens": 8, "max_length": 512, **overrides})


@pytest.fixture(scope="module")
def trained(tmp_path_factory, target_dir, data):
    root, _ = data
    run_dir = tmp_path_factory.mktemp("run")
    seen: list[dict] = []
    result = train(config(target_dir, max_steps=STEPS, log_every=5, checkpoint_every=100,
                          keep_checkpoints=2),
                   job=JOB, source=root, run_dir=run_dir, on_metrics=seen.append,
                   log=lambda line: None)
    return run_dir, result, seen


# -- blocks --------------------------------------------------------------------------------------


def test_block_mask_labels_and_weights_match_hand_built_ones():
    M = 99  # the mask token
    # Sequence 0: left padding at position 0 (so padding falls inside a block's context).
    # Sequence 1: right-padded, a single supervised position, so its second block is invalid.
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 0, 0]])
    attention = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 0, 0]])

    drawn = [sample_anchors(loss_mask, 2, torch.Generator().manual_seed(s)) for s in range(30)]
    # sorted, distinct, supervised and followed by a supervised token (5 is the last: not one)
    assert {tuple(a[0].tolist()) for a, _ in drawn} == {(2, 3), (2, 4), (3, 4)}
    for anchors, keep in drawn:  # sequence 1 has no such position: no anchor
        assert anchors[1].tolist() == [0, 0] and keep[1].tolist() == [False, False]
    again = sample_anchors(loss_mask, 2, torch.Generator().manual_seed(7))
    assert torch.equal(again[0], drawn[7][0])  # the generator alone decides
    # position 0 has no context, so it is never an anchor, even when supervised
    assert sample_anchors(torch.tensor([[1, 1, 0]]), 2, torch.Generator())[1].tolist() == [[False]]

    anchors, keep = torch.tensor([[2, 4], [3, 0]]), torch.tensor([[True, True], [True, False]])
    # keys: context positions 0..5 | block 0 (3 tokens) | block 1 (3 tokens)
    expected = [
        ["010000" "111000"] * 3 + ["011100" "000111"] * 3,  # t < 2 and < 4, padding 0 hidden
        ["111000" "111000"] * 3 + ["000000" "000111"] * 3,  # invalid block: itself only
    ]
    want = torch.tensor([[[c == "1" for c in r] for r in seq] for seq in expected])
    got = block_attention_mask(anchors, keep, attention, 3)
    assert got.shape == (2, 6, 12) and got.dtype == torch.bool
    assert torch.equal(got, want)

    gamma = 4.0
    w2 = math.exp(-1 / gamma)
    blocks = build_blocks(input_ids, loss_mask, attention, anchors, keep, block_size=3,
                          mask_token_id=M, gamma=gamma)
    assert blocks.input_ids.tolist() == [[12, M, M, 14, M, M], [23, M, M, 20, M, M]]
    assert blocks.positions.tolist() == [[2, 3, 4, 4, 5, 6], [3, 4, 5, 0, 1, 2]]
    I = IGNORE
    # the anchor has no label; past the end, unsupervised, invalid blocks: none either
    assert blocks.labels.tolist() == [[I, 13, 14, I, 15, I], [I, I, I, I, I, I]]
    assert torch.allclose(blocks.weights, torch.tensor([[0, 1, w2, 0, 1, 0], [0.0] * 6]))
    assert torch.equal(blocks.mask, want)

    assert torch.allclose(decay_weights(5, 7.0),
                          torch.tensor([0] + [math.exp(-(k - 1) / 7) for k in range(1, 5)]))
    assert decay_weights(4, None).tolist() == [0, 1, 1, 1]
    assert TrainConfig(target_model="x", decay_gamma=0).decay() is None

    # sum(w * ce) / sum(w), and accuracy counted per block position
    logits = torch.tensor([[4.0, 0, 0], [0, 3.0, 0], [0, 0, 2.0]])
    labels, weights, k = torch.tensor([0, 2, 2]), torch.tensor([1.0, w2, 1.0]), torch.tensor([1, 2, 1])
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    loss, correct, total = block_loss(logits, labels, weights, k, 3)
    assert loss.item() == pytest.approx(((weights * ce).sum() / weights.sum()).item())
    assert correct.tolist() == [0, 2, 0] and total.tolist() == [0, 2, 1]


def test_the_loss_in_chunks_is_the_loss_with_the_same_gradient():
    """chunked_block_loss (issue 43, item 5): logits made a chunk of positions at a time and made
    again in the backward pass give block_loss's loss, hits and gradient, for any chunk."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False).requires_grad_(False)
    hidden = torch.randn(37, 8, requires_grad=True)
    labels, weights = torch.randint(0, 50, (37,)), torch.rand(37)
    positions = torch.randint(1, 4, (37,))
    loss, correct, total = block_loss(head(hidden), labels, weights, positions, 4)
    (grad,) = torch.autograd.grad(loss, hidden)
    for chunk in (1, 5, 36, 37, 100):
        chunked = chunked_block_loss(head, hidden, labels, weights, positions, 4, chunk)
        torch.testing.assert_close(chunked[0], loss)
        assert torch.equal(chunked[1], correct) and torch.equal(chunked[2], total)
        torch.testing.assert_close(torch.autograd.grad(chunked[0], hidden)[0], grad)


def test_target_layer_choice():
    assert default_layer_ids(4, 1) == [2]
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # DFlash's choice for Qwen3-8B
    assert default_layer_ids(28, 3) == [1, 13, 25]
    with pytest.raises(ValueError, match=r"target_layer_ids: 4 is not a layer"):
        layer_ids(TrainConfig(target_model="x", target_layer_ids=[1, 4]), 4)


# -- training -------------------------------------------------------------------------------------


def test_loss_falls_and_the_run_leaves_metrics_and_checkpoints(trained):
    run_dir, result, seen = trained
    assert result.status == "done" and result.step == STEPS
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines == seen and result.last_metrics == lines[-1]
    assert [m["step"] for m in lines] == list(range(5, STEPS + 1, 5))
    for m in lines:
        assert set(m) == {"step", "epoch", "loss", "accuracy", "accuracy_by_position",
                          "tokens_per_s", "lr", "samples", "elapsed_s"}
        assert len(m["accuracy_by_position"]) == BLOCK - 1 and m["tokens_per_s"] > 0
    losses = [m["loss"] for m in lines]
    assert sum(losses[-20:]) / 20 < 0.25 * losses[0], [round(x, 2) for x in losses]
    assert lines[-1]["samples"] == 2 * STEPS and lines[-1]["epoch"] == (2 * STEPS - 1) // 8
    assert min(lines[-1]["accuracy_by_position"]) > 0.3

    written = [p.name for p in result.checkpoints]
    assert written == ["step_00000100", "step_00000200", f"step_{STEPS:08d}"]
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == ["step_00000200", f"step_{STEPS:08d}"]  # keep_checkpoints = 2
    last = result.checkpoints[-1]
    assert sorted(p.name for p in last.iterdir()) == \
        ["config.json", "drafter.safetensors", "training_state.pt"]
    saved = json.loads((last / "config.json").read_text())  # z-lab's DFlash HF config
    assert saved["architectures"] == ["DFlashDraftModel"] and saved["num_target_layers"] == 4
    dflash = saved["dflash_config"]
    assert dflash["block_size"] == BLOCK and dflash["target_layer_ids"] == [2]
    assert dflash["mask_token_id"] == 151935  # no mask token in the tokenizer: the last row
    from safetensors.torch import load_file
    weights = load_file(str(last / "drafter.safetensors"))
    assert not any("embed" in k or "lm_head" in k for k in weights)  # the target's, not saved
    assert sum(v.numel() for v in weights.values()) < 200_000


def test_drafter_predicts_the_targets_own_greedy_tokens(trained, target, data):
    run_dir, result, _ = trained
    _, rows = data
    after = load_drafter(result.checkpoints[-1], target)
    torch.manual_seed(0)
    before = Drafter(read_spec(result.checkpoints[-1]))

    def measure(drafter) -> tuple[list[float], float]:
        by_position, lengths = [], []
        for r in rows:
            prompt, response = r["token_ids"]["prompt"], r["token_ids"]["response"]
            # anchors in the response whose whole block the row holds
            mask = [0] * len(prompt) + [1] * (len(response) - BLOCK + 1) + [0] * (BLOCK - 1)
            out = greedy_acceptance(target, drafter, prompt + response, 12, loss_mask=mask)
            by_position.append(out["accuracy_by_position"])
            lengths.append(out["acceptance_length"])
        return [sum(p[k] for p in by_position) / len(rows) for k in range(BLOCK - 1)], \
            sum(lengths) / len(rows)

    accuracy_before, length_before = measure(before)
    accuracy_after, length_after = measure(after)
    assert accuracy_before[0] <= 0.05 and length_before < 1.1
    # (0.9 to 1.0 and 3.4 to 4.0 of 4 on the seeds tried)
    assert accuracy_after[0] >= 0.7 and min(accuracy_after) >= 0.5, accuracy_after
    assert length_after > 2.0, length_after


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(tmp_path, target_dir, data):
    root, _ = data
    # 8 rows in batches of 2: 4 steps an epoch; stopped at step 6, in the middle of epoch 1
    cfg = config(target_dir, max_steps=10, log_every=1, checkpoint_every=4, keep_checkpoints=2,
                 anchors_per_sequence=4, shuffle_buffer=3)
    quiet = {"job": JOB, "source": root, "log": lambda line: None}
    whole = train(cfg, run_dir=tmp_path / "whole", **quiet)
    assert whole.status == "done" and whole.step == 10

    calls = []
    stopped = train(cfg, run_dir=tmp_path / "split",
                    should_stop=lambda: calls.append(1) or len(calls) == 6, **quiet)
    assert stopped.status == "stopped" and stopped.step == 6
    assert [p.name for p in stopped.checkpoints] == ["step_00000004", "step_00000006"]
    resumed_lines: list[dict] = []
    resumed = train(cfg, run_dir=tmp_path / "split", on_metrics=resumed_lines.append, **quiet)
    assert resumed.status == "done" and resumed.step == 10
    assert [m["step"] for m in resumed_lines] == [7, 8, 9, 10]
    assert [p.name for p in resumed.checkpoints] == ["step_00000008", "step_00000010"]
    assert sorted(p.name for p in (tmp_path / "split" / "checkpoints").iterdir()) == \
        ["step_00000008", "step_00000010"]

    def lines(run: str) -> list[dict]:
        return [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    a, b = lines("whole"), lines("split")
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, 11))
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-5), (x, y)
        assert (x["epoch"], x["samples"], x["lr"]) == (y["epoch"], y["samples"], y["lr"])
        assert x["accuracy_by_position"] == y["accuracy_by_position"]
    assert len({m["loss"] for m in a}) == 10  # the losses do move: equality means something

    # a finished run called again trains nothing and writes nothing
    again = train(cfg, run_dir=tmp_path / "split", **quiet)
    assert (again.status, again.step, again.checkpoints) == ("done", 10, [])


# -- config ---------------------------------------------------------------------------------------


def test_rows_longer_than_max_length_are_trained_on_their_first_tokens_and_counted(
        tmp_path, target_dir, data):
    """A row longer than max_length is cut, not dropped (issue 43, item 1): the trainer reads its
    first max_length tokens, as SpecForge does; the gate and the trainer's dataset count the rows
    cut and the tokens that left out. long_rows = "drop" still drops them, and the gate says so."""
    from dflash_tasks.output.storage import LocalStorage
    from dflash_tasks.training.data.exports import validate_job
    from dflash_tasks.training.data.gate import Rules, Thresholds
    from dflash_tasks.training.torch_dataset import JobDataset

    root, rows = data
    lengths = {r["id"]: len(r["token_ids"]["prompt"]) + len(r["token_ids"]["response"])
               for r in rows}
    cut_at = sorted(lengths.values())[len(rows) // 2] - 1  # the longer half and more
    longer = {rid: n for rid, n in lengths.items() if n > cut_at}
    assert 4 <= len(longer) < len(rows)
    rules = Rules(min_loss_tokens=8, max_length=cut_at)
    dataset = JobDataset(JOB, root, rules=rules)
    samples = {s["id"]: s for s in dataset}
    assert set(samples) == set(lengths)  # every row, none dropped
    for r in rows:
        whole = r["token_ids"]["prompt"] + r["token_ids"]["response"]
        assert samples[r["id"]]["input_ids"].tolist() == whole[:cut_at]
        assert samples[r["id"]]["loss_mask"].tolist() == \
            ([0] * len(r["token_ids"]["prompt"]) + [1] * len(r["token_ids"]["response"]))[:cut_at]
    left_out = sum(n - cut_at for n in longer.values())
    assert (dataset.stats["cut"], dataset.stats["cut_tokens"]) == (len(longer), left_out)
    report, failures = validate_job(LocalStorage(root), JOB, rules, Thresholds())
    figures = report.figures()
    assert (figures["kept"], figures["cut_rows"], figures["cut_tokens"]) == \
        (len(rows), len(longer), left_out)
    assert figures["over_length"] == len(longer) and failures == []
    # the trainer trains on them: an epoch's line counts them
    said: list[str] = []
    train(config(target_dir, max_length=cut_at, max_steps=100, epochs=1, log_every=2),
          job=JOB, source=root, run_dir=tmp_path / "run", log=said.append)
    epoch = next(line for line in said if line.startswith("epoch 0 done"))
    assert f"'yielded': {len(rows)}" in epoch and f"'cut': {len(longer)}" in epoch, epoch
    # dropping stays an option
    drop = Rules(min_loss_tokens=8, max_length=cut_at, long_rows="drop")
    dropping = JobDataset(JOB, root, rules=drop)
    assert {s["id"] for s in dropping} == set(lengths) - set(longer)
    assert dropping.stats["dropped:over_length"] == len(longer) and not dropping.stats["cut"]
    _, failures = validate_job(LocalStorage(root), JOB, drop, Thresholds())
    assert any(f.startswith("too long:") and "long_rows" in f for f in failures), failures


def test_load_config_names_the_file_and_the_field(tmp_path):
    good = tmp_path / "train.toml"
    good.write_text('target_model = "/models/t"\nblock_size = 8\ntarget_layer_ids = [1, 3]\n')
    cfg = load_config(good)
    assert (cfg.block_size, cfg.target_layer_ids, cfg.learning_rate) == (8, [1, 3], 6e-4)
    assert load_config(_json(tmp_path, {"target_model": "t", "dtype": "bfloat16"})).dtype == \
        "bfloat16"

    unknown = tmp_path / "unknown.toml"
    unknown.write_text('target_model = "/models/t"\nblok_size = 8\n')
    with pytest.raises(ValueError) as err:
        load_config(unknown)
    assert str(unknown) in str(err.value) and "blok_size" in str(err.value)

    bad_type = _json(tmp_path, {"target_model": "t", "block_size": "big"})
    with pytest.raises(ValueError) as err:
        load_config(bad_type)
    assert str(bad_type) in str(err.value) and "block_size" in str(err.value)

    for data, field in (({"block_size": 16}, "target_model"),
                        ({"target_model": "t", "block_size": 1}, "block_size"),
                        ({"target_model": "t", "dtype": "fp8"}, "dtype"),
                        ({"target_model": "t", "target_layer_ids": []}, "target_layer_ids")):
        with pytest.raises(ValueError, match=field):
            load_config(_json(tmp_path, data))

    broken = tmp_path / "broken.toml"
    broken.write_text("target_model = \n")
    with pytest.raises(ValueError, match=f"{broken}: not valid TOML"):
        load_config(broken)


def _json(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "train.json"
    path.write_text(json.dumps(data))
    return path
