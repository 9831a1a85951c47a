"""The DFlash drafter: a few decoder layers shaped like the target's (Qwen3-style attention with
q/k RMSNorm, SwiGLU MLP, RoPE) that predict a whole block of tokens in one pass.

Context injection: the target's hidden states at the chosen layers, concatenated, go through
`fc` and `hidden_norm` once; in every layer the keys and values are projected from the context
features followed by the block's own (normed) hidden states, with the same k_proj / v_proj, and
the queries from the block alone. The block's token embeddings and the final projection to the
vocabulary are the target's own frozen input embeddings and LM head: the drafter owns neither,
which keeps it small and keeps its outputs in the target's token space.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DrafterSpec:
    """Everything needed to rebuild a drafter (saved as a checkpoint's config.json)."""
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    num_layers: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    target_model: str
    initializer_range: float = 0.02
    # the target's, for the HF config SGLang serves the drafter from (None in a checkpoint
    # written before it was: to_hf_config fills what SGLang defaults to)
    num_target_layers: int | None = None
    vocab_size: int | None = None
    max_position_embeddings: int | None = None

    @classmethod
    def from_target(cls, config, *, num_layers: int, target_layer_ids: list[int],
                    block_size: int, mask_token_id: int, target_model: str) -> "DrafterSpec":
        """Sizes from the target's transformers config, so each drafter layer is a target layer."""
        rope = getattr(config, "rope_parameters", None) or {}
        theta = getattr(config, "rope_theta", None) or rope.get("rope_theta", 10000.0)
        head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        return cls(hidden_size=config.hidden_size,
                   num_attention_heads=config.num_attention_heads,
                   num_key_value_heads=getattr(config, "num_key_value_heads", None)
                   or config.num_attention_heads,
                   head_dim=head_dim, intermediate_size=config.intermediate_size,
                   rms_norm_eps=config.rms_norm_eps, rope_theta=float(theta),
                   num_layers=num_layers, target_layer_ids=tuple(target_layer_ids),
                   block_size=block_size, mask_token_id=mask_token_id,
                   target_model=str(target_model),
                   initializer_range=getattr(config, "initializer_range", 0.02),
                   num_target_layers=config.num_hidden_layers, vocab_size=config.vocab_size,
                   max_position_embeddings=getattr(config, "max_position_embeddings", None))

    def to_json(self) -> dict:
        return {**asdict(self), "target_layer_ids": list(self.target_layer_ids)}

    @classmethod
    def from_json(cls, data: dict) -> "DrafterSpec":
        """From to_json's dict, or from to_hf_config's (a checkpoint's config.json)."""
        if "dflash_config" in data:
            return cls.from_hf_config(data)
        return cls(**{**data, "target_layer_ids": tuple(data["target_layer_ids"])})

    def to_hf_config(self) -> dict:
        """The drafter as a Hugging Face config in z-lab's DFlash format, which SGLang's DFLASH
        speculative decoding loads (`--speculative-draft-model-path`: `DFlashDraftModel`, its
        `dflash_config` parsed by sglang.srt.speculative.dflash_utils): a Qwen3-style config of
        the drafter's layers, the target's depth, and the block size, mask token and target
        layers in `dflash_config`. `target_model` (where it was trained) is this project's."""
        return {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "num_hidden_layers": self.num_layers,
            "num_target_layers": self.num_target_layers or max(self.target_layer_ids) + 1,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "max_position_embeddings": self.max_position_embeddings or 40960,
            "vocab_size": self.vocab_size or self.mask_token_id + 1,
            "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
            "use_cache": False, "is_causal": False, "dtype": "float32",
            "initializer_range": self.initializer_range,
            "dflash_config": {"block_size": self.block_size, "mask_token_id": self.mask_token_id,
                              "target_layer_ids": list(self.target_layer_ids)},
            "target_model": self.target_model,
        }

    @classmethod
    def from_hf_config(cls, data: dict) -> "DrafterSpec":
        dflash = data["dflash_config"]
        return cls(hidden_size=data["hidden_size"],
                   num_attention_heads=data["num_attention_heads"],
                   num_key_value_heads=data["num_key_value_heads"], head_dim=data["head_dim"],
                   intermediate_size=data["intermediate_size"],
                   rms_norm_eps=data["rms_norm_eps"], rope_theta=float(data["rope_theta"]),
                   num_layers=data["num_hidden_layers"],
                   target_layer_ids=tuple(dflash["target_layer_ids"]),
                   block_size=dflash["block_size"], mask_token_id=dflash["mask_token_id"],
                   target_model=data.get("target_model", ""),
                   initializer_range=data.get("initializer_range", 0.02),
                   num_target_layers=data.get("num_target_layers"),
                   vocab_size=data.get("vocab_size"),
                   max_position_embeddings=data.get("max_position_embeddings"))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (the rotate-half layout of Llama/Qwen) of x [batch, heads, seq, dim] at
    integer positions [batch, seq]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = positions.float()[..., None] * inv_freq  # [batch, seq, dim / 2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # [batch, 1, seq, dim]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, spec: DrafterSpec):
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.heads, self.kv_heads, self.head_dim = spec.num_attention_heads, spec.num_key_value_heads, d
        self.theta = spec.rope_theta
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, spec.rms_norm_eps)
        self.k_norm = RMSNorm(d, spec.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n, self.head_dim)

    def forward(self, block: torch.Tensor, context: torch.Tensor, block_pos: torch.Tensor,
                context_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """block [b, q, h] (already normed), context [b, t, h]; mask [b, q, t + q] (True: attend)."""
        kv_in = torch.cat([context, block], dim=1)
        kv_pos = torch.cat([context_pos, block_pos], dim=1)
        q = self.q_norm(self._heads(self.q_proj(block), self.heads)).transpose(1, 2)
        k = self.k_norm(self._heads(self.k_proj(kv_in), self.kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(kv_in), self.kv_heads).transpose(1, 2)
        q, k = rope(q, block_pos, self.theta), rope(k, kv_pos, self.theta)
        # grouped-query attention: each kv head serves heads / kv_heads query heads
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.o_proj(out.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, spec: DrafterSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: DrafterSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, context, block_pos, context_pos, mask):
        x = x + self.self_attn(self.input_layernorm(x), context, block_pos, context_pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    def __init__(self, spec: DrafterSpec):
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        self.fc = nn.Linear(len(spec.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, spec.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(h, spec.rms_norm_eps)
        # the target family's initialisation (normal, std initializer_range), as in DFlash,
        # rather than nn.Linear's fan-in uniform one
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=spec.initializer_range)

    def forward(self, target_hidden: torch.Tensor, block_embeds: torch.Tensor,
                context_pos: torch.Tensor, block_pos: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """The final (normed) hidden state of every block token: [batch, q, hidden].

        target_hidden [b, t, layers * hidden]: the context; block_embeds [b, q, hidden]: the
        target's embeddings of the block tokens; positions for RoPE; mask [b, q, t + q]."""
        context = self.hidden_norm(self.fc(target_hidden))
        x = block_embeds
        for layer in self.layers:
            x = layer(x, context, block_pos, context_pos, mask)
        return self.norm(x)


def block_hidden(target: nn.Module, drafter: Drafter, target_hidden: torch.Tensor,
                 block_ids: torch.Tensor, block_pos: torch.Tensor,
                 mask: torch.Tensor, forward: nn.Module | None = None) -> torch.Tensor:
    """The drafter's output for the block tokens, embedded with the target's frozen embeddings.
    Project with `logits` (only where needed: the vocabulary is large). `forward`: what runs
    the drafter, when not itself (DDP around it)."""
    dtype = drafter.fc.weight.dtype
    embeds = target.get_input_embeddings()(block_ids).to(dtype)
    context_pos = torch.arange(target_hidden.shape[1], device=block_ids.device)
    context_pos = context_pos.expand(block_ids.shape[0], -1)
    return (forward or drafter)(target_hidden.to(dtype), embeds, context_pos, block_pos, mask)


def logits(target: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The target's frozen LM head over drafter hidden states, as float32 logits."""
    head = target.get_output_embeddings()
    return head(hidden.to(head.weight.dtype)).float()
