"""The frozen target model: loading it, which of its layers feed the drafter, the mask token,
and its hidden states at those layers."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dflash_tasks.training.reference.config import TrainConfig


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_target(path: str | Path, *, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> nn.Module:
    """The target causal LM from a local directory, in eval mode, every weight frozen."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)
    target.to(device).eval()
    target.requires_grad_(False)
    return target


def default_layer_ids(num_layers: int, n: int) -> list[int]:
    """DFlash's choice: one target layer per drafter layer, spread from layer 1 to layer
    num_layers - 3 (the first layer is still mostly the embedding, the last ones are already
    specialised to the target's own next token); the middle layer for a single one."""
    if n == 1:
        ids = [num_layers // 2]
    else:
        ids = [round(1 + i * (num_layers - 4) / (n - 1)) for i in range(n)]
    return [min(max(i, 0), num_layers - 1) for i in ids]


def layer_ids(config: TrainConfig, num_layers: int) -> list[int]:
    """config.target_layer_ids checked against the target's depth, or the default."""
    if config.target_layer_ids is None:
        return default_layer_ids(num_layers, config.drafter_layers)
    bad = [i for i in config.target_layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"target_layer_ids: {bad[0]} is not a layer of the target "
                         f"(it has {num_layers}: 0..{num_layers - 1})")
    return list(config.target_layer_ids)


def mask_token_id(config: TrainConfig, tokenizer, vocab_size: int) -> int:
    """config.mask_token_id, else the tokenizer's mask token, else the last embedding row: Qwen3
    pads its embedding to 151,936 rows past its last real token (151,668), and those rows are
    never produced, so one of them is free to mean "to be predicted"."""
    mask = config.mask_token_id
    if mask is None:
        mask = getattr(tokenizer, "mask_token_id", None)
    if mask is None:
        mask = vocab_size - 1
    if not 0 <= mask < vocab_size:
        raise ValueError(f"mask_token_id: {mask} is not in the target's vocabulary "
                         f"(0..{vocab_size - 1})")
    return int(mask)


def kv_cache(out) -> dict:
    """The KV cache a forward pass returned, as the next pass takes it: transformers 5 names it
    `cache` (out.cache, cache=; `past_key_values` is deprecated there and gone from the output),
    4.x `past_key_values`. Both ends of the declared range run the same decoding."""
    cache = getattr(out, "cache", None)
    if cache is not None:
        return {"cache": cache}
    return {"past_key_values": out.past_key_values}


@torch.no_grad()
def target_hidden(target: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  layers: list[int]) -> torch.Tensor:
    """The target's hidden states after each of `layers`, concatenated on the feature axis:
    [batch, seq, len(layers) * hidden]. Only the decoder runs: the LM head over the whole
    sequence (seq x 151,936 logits) is never needed."""
    out = target.base_model(input_ids=input_ids, attention_mask=attention_mask,
                            output_hidden_states=True, use_cache=False)
    # hidden_states[0] is the embedding output, so layer i's output is hidden_states[i + 1]
    return torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1)
