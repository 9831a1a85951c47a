"""Run by tests/sglang_real/test_sglang_dflash.py with the real SGLang 0.5.23's Python (its
venv): a reference checkpoint loaded as SGLang's DFLASH speculative decoding loads a draft model,
its config through SGLang's own `parse_dflash_draft_config`, its weights through
`DFlashDraftModel.load_weights` from SGLang's safetensors iterator, and the parts of the model
that run without a scheduler's batch (everything but the attention kernel) applied to the inputs
the test gives. Writes what it found to OUT (JSON) and the outputs to OUT's .safetensors.

    python sglang_dflash_side.py CHECKPOINT INPUTS.safetensors OUT.json
"""
from __future__ import annotations

import glob
import json
import math
import os
import sys

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoConfig  # noqa: E402


def single_process() -> None:
    """The process groups SGLang's layers need even at tp 1 (what sglang.test's
    init_single_process_dist does; importing sglang.test pulls in its benchmark datasets)."""
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ["PORT"],
                        "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ[name] = value
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                                backend="gloo")
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1, device="cpu"),
            role="test", ranks=SpawnRanks(world_rank=0))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    parallel_state.initialize_model_parallel(backend="gloo")


def main(checkpoint: str, inputs_path: str, out_path: str) -> None:
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    config = AutoConfig.from_pretrained(checkpoint)
    parsed = parse_dflash_draft_config(draft_hf_config=config)
    single_process()
    from sglang.srt.models.dflash import DFlashDraftModel

    model = DFlashDraftModel(config).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(math.nan)  # a parameter still NaN after loading was never loaded
    loaded: dict[str, list[str]] = {}  # checkpoint tensor -> the parameters it was loaded into
    current = [""]
    for pname, p in params.items():
        inner = getattr(p, "weight_loader", None)

        def record(param, weight, *shard, _name=pname, _inner=inner):
            loaded.setdefault(current[0], []).append(_name)
            if _inner is None:
                from sglang.srt.model_loader.weight_utils import default_weight_loader
                return default_weight_loader(param, weight, *shard)
            return _inner(param, weight, *shard)
        p.weight_loader = record
    files = sorted(glob.glob(os.path.join(checkpoint, "*.safetensors")))
    names = []
    for name, tensor in safetensors_weights_iterator(files):
        names.append(name)
        current[0] = name
        model.load_weights([(name, tensor)])
    missing = [n for n, p in params.items() if torch.isnan(p).any()]

    x = load_file(inputs_path)
    out = {}
    with torch.no_grad():
        out["context"] = model.project_target_hidden(x["target_hidden"])
        out["norm"] = model.norm.forward_native(x["hidden"])
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            out[f"layers.{i}.input_layernorm"] = layer.input_layernorm.forward_native(x["hidden"])
            qkv, _ = attn.qkv_proj(x["hidden"])
            q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            out[f"layers.{i}.q"], out[f"layers.{i}.k"], out[f"layers.{i}.v"] = q, k, v
            ck, cv = attn.kv_proj_only(x["context_in"])
            out[f"layers.{i}.context_k"], out[f"layers.{i}.context_v"] = ck, cv
            qn = attn.q_norm.forward_native(q.reshape(-1, attn.head_dim)).view_as(q)
            kn = attn.k_norm.forward_native(k.reshape(-1, attn.head_dim)).view_as(k)
            qr, kr = attn.rotary_emb.forward_native(x["positions"], qn, kn)
            out[f"layers.{i}.q_roped"], out[f"layers.{i}.k_roped"] = qr, kr
            out[f"layers.{i}.mlp"] = layer.mlp(x["hidden"])
            o, _ = attn.o_proj(x["attn_out"])
            out[f"layers.{i}.o_proj"] = o
    save_file({k: v.contiguous() for k, v in out.items()}, out_path.replace(".json", ".safetensors"))
    with open(out_path, "w") as f:
        json.dump({"num_hidden_layers": parsed.num_hidden_layers,
                   "num_target_layers": parsed.num_target_layers,
                   "block_size": model.block_size, "target_layer_ids": parsed.target_layer_ids,
                   "mask_token_id": parsed.mask_token_id,
                   "num_context_features": model.num_context_features,
                   "architectures": list(config.architectures or []),
                   "tensors": names, "loaded": loaded, "missing": missing,
                   "parameters": sorted(params)}, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
