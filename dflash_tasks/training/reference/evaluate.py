"""What the drafter would get accepted: its block predictions against the target's own greedy
continuation (not against the dataset's tokens, which a sampled generation may have drawn
differently), and the acceptance length speculative decoding would reach with them."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from dflash_tasks.training.reference.blocks import build_blocks, sample_anchors
from dflash_tasks.training.reference.model import Drafter, block_hidden, logits
from dflash_tasks.training.reference.target import kv_cache, target_hidden


@torch.no_grad()
def greedy_continuation(target: nn.Module, prefix: torch.Tensor, n: int) -> torch.Tensor:
    """The n tokens the target generates greedily after `prefix` (1-D), with its KV cache."""
    out = target(input_ids=prefix[None], use_cache=True, logits_to_keep=1)
    tokens = [out.logits[0, -1].argmax()]
    while len(tokens) < n:
        out = target(input_ids=tokens[-1].view(1, 1), use_cache=True, **kv_cache(out))
        tokens.append(out.logits[0, -1].argmax())
    return torch.stack(tokens)


@torch.no_grad()
def greedy_acceptance(target: nn.Module, drafter: Drafter, input_ids: Sequence[int] | torch.Tensor,
                      anchors: Sequence[int] | int, *, loss_mask: Sequence[int] | None = None,
                      seed: int = 0) -> dict:
    """Per block position k = 1..block_size-1, how often the drafter's token equals the target's
    greedy token there, and the mean acceptance length (1 + the leading matches: the target's
    verification pass always yields one token of its own).

    For an anchor a, the target continues x[0..a] greedily; the drafter, given the target's
    hidden states of x[0..a-1] and the anchor token x[a], predicts the block in one pass.
    `anchors`: positions (1 <= a < len), or a count drawn at random (with `seed`) among the
    positions sample_anchors draws (1 <= a < len - 1; loss_mask 1 at a and a + 1, when given)."""
    device = target.get_input_embeddings().weight.device
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device).flatten()
    seq, block_size = len(ids), drafter.spec.block_size
    if isinstance(anchors, int):
        mask = torch.ones(seq, dtype=torch.long) if loss_mask is None else \
            torch.as_tensor(loss_mask, dtype=torch.long)
        drawn, keep = sample_anchors(mask[None], anchors,
                                     torch.Generator().manual_seed(seed))
        anchors = drawn[keep].tolist()
    if not anchors or not all(1 <= a < seq for a in anchors):
        raise ValueError(f"anchors must be positions in [1, {seq}), got {list(anchors)}")

    greedy = torch.stack([greedy_continuation(target, ids[:a + 1], block_size - 1)
                          for a in anchors])  # [n, block_size - 1]

    # All anchors in one drafter pass over the whole sequence: the target is causal, so its
    # hidden states at t < a are the same as on x[0..a-1] alone, and the mask hides t >= a.
    at = torch.tensor([anchors], device=device)
    ones = torch.ones(1, seq, dtype=torch.long, device=device)
    blocks = build_blocks(ids[None], ones, ones, at, torch.ones_like(at, dtype=torch.bool),
                          block_size=block_size, mask_token_id=drafter.spec.mask_token_id,
                          gamma=None)
    hidden = target_hidden(target, ids[None], ones, list(drafter.spec.target_layer_ids))
    out = block_hidden(target, drafter, hidden, blocks.input_ids, blocks.positions, blocks.mask)
    predicted = logits(target, out[0]).argmax(-1).view(len(anchors), block_size)[:, 1:]

    match = predicted == greedy
    accepted = 1 + match.long().cumprod(dim=1).sum(dim=1)
    return {"anchors": list(anchors),
            "accuracy_by_position": match.float().mean(dim=0).tolist(),
            "acceptance_length": accepted.float().mean().item(),
            "acceptance_lengths": accepted.tolist()}
