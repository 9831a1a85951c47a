"""A reference checkpoint is a drafter SGLang serves (issue 43, item 2): the real SGLang 0.5.23
(`make test-sglang`'s environment) reads a checkpoint the reference trainer writes as it reads
the draft model of `--speculative-algorithm DFLASH --speculative-draft-model-path`: its config
through `parse_dflash_draft_config`, its weights through `DFlashDraftModel.load_weights`, every
tensor into a parameter and every parameter loaded. Then every part of SGLang's model that runs
on CPU without a scheduler's batch (the context projection, the norms, the fused q/k/v and the
context's k/v, q/k norm and RoPE, the MLP, o_proj: all but the attention kernel) gives what the
project's drafter gives on the same inputs. Under plain `make test` it is skipped."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import free_port

VENV = os.environ.get("DFLASH_SGLANG_VENV")
pytestmark = pytest.mark.skipif(not VENV, reason="the real SGLang server: run `make test-sglang`")
SIDE = Path(__file__).with_name("sglang_dflash_side.py")


def test_sglang_loads_a_reference_checkpoint_and_computes_what_the_drafter_does(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_target import build_tiny_target

    from dflash_tasks.training.reference.checkpoints import save_checkpoint
    from dflash_tasks.training.reference.model import Drafter, DrafterSpec, rope
    from dflash_tasks.training.reference.target import load_target

    target = load_target(build_tiny_target(tmp_path / "target", layers=4))
    spec = DrafterSpec.from_target(target.config, num_layers=2, target_layer_ids=[1, 2],
                                   block_size=8, mask_token_id=151935,
                                   target_model=str(tmp_path / "target"))
    torch.manual_seed(3)
    drafter = Drafter(spec).eval()
    with torch.no_grad():  # no weight left at its initial value (norms start at 1)
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn_like(p))
    checkpoint = save_checkpoint(tmp_path / "run", 7, drafter, {}, keep=1)

    n, h, heads, d = 5, spec.hidden_size, spec.num_attention_heads, spec.head_dim
    inputs = {"target_hidden": torch.randn(n, 2 * h), "hidden": torch.randn(n, h),
              "context_in": torch.randn(n, h), "positions": torch.tensor([0, 3, 4, 9, 40]),
              "attn_out": torch.randn(n, heads * d)}
    save_file(inputs, str(tmp_path / "inputs.safetensors"))
    report_path = tmp_path / "sglang.json"
    done = subprocess.run([str(Path(VENV) / "bin" / "python"), "-W", "ignore", str(SIDE),
                           str(checkpoint), str(tmp_path / "inputs.safetensors"),
                           str(report_path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PORT": str(free_port())})
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(report_path.read_text())

    # the config, as SGLang's parser reads it
    assert report["architectures"] == ["DFlashDraftModel"]
    assert (report["num_hidden_layers"], report["num_target_layers"], report["block_size"],
            report["target_layer_ids"], report["mask_token_id"],
            report["num_context_features"]) == (2, 4, 8, [1, 2], 151935, 2)
    # every tensor of the checkpoint loaded into a parameter, every parameter loaded
    assert sorted(report["tensors"]) == sorted(drafter.state_dict())
    unexpected = [t for t in report["tensors"] if len(report["loaded"].get(t, [])) != 1]
    assert not unexpected, unexpected
    assert sorted({p for ps in report["loaded"].values() for p in ps}) == report["parameters"]
    assert report["missing"] == []

    sglang = load_file(str(report_path.with_suffix(".safetensors")))
    x = inputs
    with torch.no_grad():
        ours = {"context": drafter.hidden_norm(drafter.fc(x["target_hidden"])),
                "norm": drafter.norm(x["hidden"])}
        for i, layer in enumerate(drafter.layers):
            attn = layer.self_attn
            q, k, v = attn.q_proj(x["hidden"]), attn.k_proj(x["hidden"]), attn.v_proj(x["hidden"])
            ours |= {f"layers.{i}.input_layernorm": layer.input_layernorm(x["hidden"]),
                     f"layers.{i}.q": q, f"layers.{i}.k": k, f"layers.{i}.v": v,
                     f"layers.{i}.context_k": attn.k_proj(x["context_in"]),
                     f"layers.{i}.context_v": attn.v_proj(x["context_in"]),
                     f"layers.{i}.mlp": layer.mlp(x["hidden"]),
                     f"layers.{i}.o_proj": attn.o_proj(x["attn_out"])}
            for name, t, norm, count in (("q", q, attn.q_norm, heads),
                                         ("k", k, attn.k_norm, spec.num_key_value_heads)):
                by_head = norm(t.view(1, n, count, d)).transpose(1, 2)  # [1, heads, n, d]
                roped = rope(by_head, x["positions"][None], spec.rope_theta)
                ours[f"layers.{i}.{name}_roped"] = roped.transpose(1, 2).reshape(n, count * d)
    assert sorted(ours) == sorted(sglang)
    for name in sorted(ours):
        torch.testing.assert_close(sglang[name], ours[name], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
