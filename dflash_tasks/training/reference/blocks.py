"""Training blocks, as pure functions of a padded batch: where the blocks start (anchors), what
the drafter sees (the anchor token then MASKs), what it must predict (labels and their decay
weights), what each block may attend to, and the loss and accuracy over them.

Everything mirrors inference. There the drafter is handed the last accepted token (the anchor,
at position a) and the target's hidden states of everything before it (positions < a: the
target has not yet run on the anchor) and fills the next block_size - 1 positions in one pass.
So block position k is labelled with the token at a + k, the token the target will produce
there, and position 0 (the anchor, already known) carries no loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE = -100  # label of a position with no loss (F.cross_entropy's ignore_index)


def sample_anchors(loss_mask: torch.Tensor, n: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [batch, width], keep [batch, width]): per sequence, up to n distinct positions
    sorted, drawn uniformly among the candidates: a >= 1 (a block needs some context before its
    anchor) with loss_mask[a] and loss_mask[a + 1] both 1 (block position 1, the one that
    decides whether anything is accepted, has a label). width = min(n, the most candidates of a
    sequence), at least 1; a sequence with fewer candidates has its missing blocks marked
    keep=False (anchor 0, no loss).

    The draw is SpecForge 0.2.0's (`OnlineDFlashModel._sample_anchor_positions`: one uniform
    number per candidate, the `width` smallest win), from `generator` instead of the global
    random state: seeded alike, both pick the same anchors (tests/test_dflash_vs_specforge.py)."""
    batch = loss_mask.shape[0]
    if loss_mask.shape[1] < 3:  # no a >= 1 with a + 1 inside the sequence
        return (torch.zeros(batch, 1, dtype=torch.long, device=loss_mask.device),
                torch.zeros(batch, 1, dtype=torch.bool, device=loss_mask.device))
    mask = loss_mask.detach().cpu() > 0  # the generator is a CPU one: the same draws on any device
    valid = mask[:, :-1] & mask[:, 1:]  # [batch, seq - 1]: candidate a is column a
    valid[:, 0] = False
    counts = valid.sum(dim=1)
    width = max(1, min(n, int(counts.max())))
    draws = torch.rand(valid.shape, generator=generator).masked_fill_(~valid, 2.0)
    chosen = draws.argsort(dim=1)[:, :width]
    keep = torch.arange(width) < counts.clamp(max=width)[:, None]
    sentinel = valid.shape[1]  # past every candidate: sorts the missing blocks last
    anchors = torch.where(keep, chosen, sentinel).sort(dim=1).values
    keep = anchors < sentinel
    anchors = torch.where(keep, anchors, 0)
    return anchors.to(loss_mask.device), keep.to(loss_mask.device)


def decay_weights(block_size: int, gamma: float | None) -> torch.Tensor:
    """Loss weight of each block position: 0 for the anchor, exp(-(k - 1) / gamma) for k >= 1
    (DFlash, eq. 4): an early miss ends acceptance, so early positions matter most; gamma None:
    all 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.ones(block_size) if gamma is None else torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def block_attention_mask(anchors: torch.Tensor, keep: torch.Tensor, attention_mask: torch.Tensor,
                         block_size: int) -> torch.Tensor:
    """Bool [batch, n * block_size, seq + n * block_size] over keys [context | all blocks]:
    a query of block j sees the context positions t < anchor_j that are not padding, and all of
    its own block (bidirectional: the block is filled in one pass), nothing of other blocks. A
    block with keep=False sees only itself, so that no row is all False (SDPA can give NaN)."""
    batch, n = anchors.shape
    seq = attention_mask.shape[1]
    t = torch.arange(seq, device=anchors.device)
    context = (t < anchors[..., None]) & attention_mask.bool()[:, None, :] & keep[..., None]
    block_of = torch.arange(n * block_size, device=anchors.device) // block_size
    own = block_of[:, None] == block_of[None, :]  # [q, q]
    context = context.repeat_interleave(block_size, dim=1)  # [batch, q, seq]
    return torch.cat([context, own.expand(batch, -1, -1)], dim=2)


@dataclass
class Blocks:
    """A batch's blocks, flattened to n * block_size positions per sequence."""
    input_ids: torch.Tensor   # [batch, q]: anchor token, then mask tokens
    positions: torch.Tensor   # [batch, q]: a + k, the RoPE position of each block token
    labels: torch.Tensor      # [batch, q]: the token at a + k, IGNORE where there is no loss
    weights: torch.Tensor     # [batch, q]: decay weight where labelled, else 0
    mask: torch.Tensor        # [batch, q, seq + q]


def build_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, attention_mask: torch.Tensor,
                 anchors: torch.Tensor, keep: torch.Tensor, *, block_size: int,
                 mask_token_id: int, gamma: float | None) -> Blocks:
    """The blocks of the anchors: block position k of anchor a is labelled x[a + k] when
    k >= 1, a + k is inside the sequence, loss_mask[a + k] is 1 and the block is kept."""
    seq = input_ids.shape[1]
    k = torch.arange(block_size, device=anchors.device)
    positions = anchors[..., None] + k  # [batch, n, block]
    inside = positions < seq
    at = positions.clamp(max=seq - 1)
    targets = torch.gather(input_ids, 1, at.flatten(1)).view_as(at)
    supervised = torch.gather(loss_mask, 1, at.flatten(1)).view_as(at).bool()
    valid = inside & supervised & keep[..., None] & (k > 0)
    labels = torch.where(valid, targets, torch.full_like(targets, IGNORE))
    weights = decay_weights(block_size, gamma).to(anchors.device) * valid
    block_ids = torch.full_like(targets, mask_token_id)
    block_ids[..., 0] = torch.gather(input_ids, 1, anchors)
    return Blocks(block_ids.flatten(1), positions.flatten(1), labels.flatten(1),
                  weights.flatten(1), block_attention_mask(anchors, keep, attention_mask, block_size))


def block_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
               block_pos: torch.Tensor,
               block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, correct, total): the weighted cross-entropy sum(w * ce) / sum(w), and per block
    position the predictions that matched their label and the labelled positions ([block_size]
    counts on the CPU). The inputs are flat, over the m labelled positions only (logits
    [m, vocab]: the vocabulary is too large to project every block position needlessly)."""
    ce = F.cross_entropy(logits, labels, reduction="none")
    loss = (weights * ce).sum() / weights.sum().clamp_min(torch.finfo(weights.dtype).tiny)
    hit = (logits.argmax(-1) == labels).long()
    correct = torch.zeros(block_size, dtype=torch.long, device=labels.device)
    total = torch.zeros_like(correct)
    correct.index_add_(0, block_pos, hit)
    total.index_add_(0, block_pos, torch.ones_like(hit))
    return loss, correct.cpu(), total.cpu()


def chunked_block_loss(project: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                       labels: torch.Tensor, weights: torch.Tensor, block_pos: torch.Tensor,
                       block_size: int,
                       chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """block_loss of `project(hidden)` ([m, hidden] to [m, vocab] logits), `chunk` positions at
    a time: each chunk's logits are made, reduced to its weighted cross-entropy and hits, and
    dropped, then made again in the backward pass (torch.utils.checkpoint), so a step holds one
    chunk's logits instead of all m's (512 anchors x 15 labelled positions x 151,936 float32
    logits are 4.7 GB, before softmax and its gradient; SpecForge chunks its loss too). The
    same loss as block_loss, summed in another order."""
    correct = torch.zeros(block_size, dtype=torch.long, device=labels.device)
    total = torch.zeros_like(correct)
    loss = hidden.new_zeros((), dtype=torch.float32)
    for first in range(0, labels.shape[0], chunk):
        part = slice(first, first + chunk)
        weighted, hit = checkpoint(_chunk_terms, project, hidden[part], labels[part],
                                   weights[part], use_reentrant=False)
        loss = loss + weighted
        correct.index_add_(0, block_pos[part], hit)
        total.index_add_(0, block_pos[part], torch.ones_like(hit))
    loss = loss / weights.sum().clamp_min(torch.finfo(weights.dtype).tiny)
    return loss, correct.cpu(), total.cpu()


def _chunk_terms(project, hidden: torch.Tensor, labels: torch.Tensor,
                 weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scores = project(hidden)
    ce = F.cross_entropy(scores, labels, reduction="none")
    return (weights * ce).sum(), (scores.argmax(-1) == labels).long()


def position_accuracy(correct: torch.Tensor, total: torch.Tensor) -> list[float | None]:
    """Accuracy at block positions 1..block_size-1 (None where nothing was labelled)."""
    return [None if int(t) == 0 else int(c) / int(t) for c, t in zip(correct[1:], total[1:])]
