"""The acceptance length tau, as the DFlash and DSpark papers report it, measured by replaying
speculative decoding along a known continuation.

One verification step: the last token produced is the anchor, at position p. The drafter fills
the block's other block_size - 1 positions in one pass (drafts d_1..d_{B-1}); the target runs
once over the block, accepts the longest prefix d_1..d_m equal to its own tokens x[p+1..p+m],
and adds one token of its own after them: the bonus, x[p+m+1]. The step produced m + 1 tokens
and the next anchor is p + m + 1. A prompt's tau = tokens produced / verification steps:
SpecForge's DFlash `spec_generate` records `acceptance_length + 1` per step, the bonus counted,
and the papers' tau (DSpark's Table 1) is the mean of those; over many prompts, the mean of the
prompts' own (heldout.py). The
first token of the answer comes from the prefill, not from a verification step.

Acceptance at block position k (1..B-1) is the share of steps whose first k drafts were all
accepted (m >= k): non-increasing in k by definition, and tau = 1 + sum over k of it, except at
the end of a generation: there (the stop token, or the max_new_tokens cap) nothing follows the
accepted drafts, so a step whose drafts reach the end produces m tokens and no bonus, and drafts
past the end are not accepted. The tokens of all steps add up to len(continuation) - 1 exactly.

Replaying is exact because the target's output does not depend on the drafts: at temperature 0
greedy verification outputs the target's greedy continuation whatever was drafted; at T > 0,
with SpecForge's rule (a draft is accepted when it equals the target's sampled token there),
the output is a sample of the target, and a sampled continuation replays it in distribution.
Drafts are the drafter's greedy tokens, as in `spec_generate`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from dflash_tasks.training.reference.blocks import build_blocks
from dflash_tasks.training.reference.model import Drafter, block_hidden, logits
from dflash_tasks.training.reference.target import kv_cache, target_hidden

# Drafted positions projected to the vocabulary per drafter pass: logits are [n, 151,936]
# float32, 155 MB at 256 positions.
DRAFTS_PER_PASS = 256


@dataclass
class Acceptance:
    """Counts over verification steps; `tau` and `by_position` are what the papers report."""
    block_size: int
    steps: int = 0                  # verification steps
    tokens: int = 0                 # tokens they produced (accepted drafts + bonus tokens)
    accepted: list[int] = field(default_factory=list)  # [k-1]: steps whose first k drafts passed

    def __post_init__(self) -> None:
        if not self.accepted:
            self.accepted = [0] * (self.block_size - 1)

    def add_step(self, matched: int, produced: int) -> None:
        self.steps += 1
        self.tokens += produced
        for k in range(matched):
            self.accepted[k] += 1

    def merge(self, other: "Acceptance") -> "Acceptance":
        if other.block_size != self.block_size:
            raise ValueError(f"block sizes differ: {self.block_size} and {other.block_size}")
        self.steps += other.steps
        self.tokens += other.tokens
        self.accepted = [a + b for a, b in zip(self.accepted, other.accepted)]
        return self

    @property
    def tau(self) -> float | None:
        return self.tokens / self.steps if self.steps else None

    def by_position(self) -> list[float | None]:
        """Acceptance at block positions 1..block_size-1."""
        return [a / self.steps if self.steps else None for a in self.accepted]

    def to_json(self) -> dict:
        return {"block_size": self.block_size, "tau": self.tau, "steps": self.steps,
                "tokens": self.tokens, "accepted": list(self.accepted),
                "acceptance_by_position": self.by_position()}


def replay(drafts_at: Callable[[int], Sequence[int]], ids: Sequence[int], start: int,
           block_size: int) -> Acceptance:
    """Speculative decoding along `ids`, whose tokens from `start` on are the target's output
    (ids[start] is the first, from the prefill): `drafts_at(p)` is the drafter's block_size - 1
    tokens for the anchor at p. The module docstring defines what is counted."""
    if not 0 <= start < len(ids):
        raise ValueError(f"start {start} is not a position of the {len(ids)} tokens")
    counts, p, last = Acceptance(block_size), start, len(ids) - 1
    while p < last:
        drafts = list(drafts_at(p))[:block_size - 1]
        left = last - p  # tokens the target still produces after the anchor
        matched = 0
        while matched < min(len(drafts), left) and drafts[matched] == ids[p + 1 + matched]:
            matched += 1
        produced = matched + 1 if matched < left else matched  # no bonus past the end
        counts.add_step(matched, produced)
        p += produced
    return counts


@torch.no_grad()
def drafts_for(target: nn.Module, drafter: Drafter, ids: torch.Tensor,
               anchors: Sequence[int]) -> torch.Tensor:
    """The drafter's greedy tokens for each anchor, [len(anchors), block_size - 1], from the
    target's hidden states of ids (1-D) before the anchor; every anchor a pass shares, with
    the attention mask of training (blocks.build_blocks) hiding t >= a."""
    block_size = drafter.spec.block_size
    hidden = target_hidden(target, ids[None], torch.ones_like(ids)[None],
                           list(drafter.spec.target_layer_ids))
    per_pass = max(1, DRAFTS_PER_PASS // (block_size - 1))
    out = []
    for i in range(0, len(anchors), per_pass):
        chunk = list(anchors[i:i + per_pass])
        seen = max(chunk) + 1  # the context a pass needs: positions before its last anchor
        at = torch.tensor([chunk], device=ids.device)
        ones = torch.ones(1, seen, dtype=torch.long, device=ids.device)
        blocks = build_blocks(ids[None, :seen], ones, ones, at,
                              torch.ones_like(at, dtype=torch.bool), block_size=block_size, mask_token_id=drafter.spec.mask_token_id,
                              gamma=None)
        states = block_hidden(target, drafter, hidden[:, :seen], blocks.input_ids,
                              blocks.positions, blocks.mask)
        drafted = states[0].view(len(chunk), block_size, -1)[:, 1:]
        out.append(logits(target, drafted).argmax(-1))
    return torch.cat(out)


@torch.no_grad()
def measure(target: nn.Module, drafter: Drafter, ids: Sequence[int] | torch.Tensor,
            start: int) -> Acceptance:
    """`replay` along ids with the drafter's own drafts: ids[start:] is the target's output."""
    device = target.get_input_embeddings().weight.device
    ids = torch.as_tensor(ids, dtype=torch.long, device=device).flatten()
    if not 1 <= start < len(ids):
        raise ValueError(f"start {start}: the output must follow at least one prompt token "
                         f"and lie inside the {len(ids)} tokens")
    anchors = list(range(start, len(ids) - 1))
    drafted = drafts_for(target, drafter, ids, anchors).tolist() if anchors else []
    tokens = ids.tolist()
    return replay(lambda p: drafted[p - start], tokens, start, drafter.spec.block_size)


@torch.no_grad()
def continuation(target: nn.Module, prompt: Sequence[int], max_new_tokens: int, *,
                 temperature: float = 0.0, stop_ids: Sequence[int] = (),
                 generator: torch.Generator | None = None) -> list[int]:
    """The target's own answer to `prompt`: greedy at temperature 0, else sampled from
    softmax(logits / temperature) (SpecForge's `sample`: no top-p, no top-k), ending with the
    first stop token or at max_new_tokens."""
    device = target.get_input_embeddings().weight.device
    ids = torch.as_tensor(list(prompt), dtype=torch.long, device=device)[None]
    out = target(input_ids=ids, use_cache=True, logits_to_keep=1)
    produced: list[int] = []
    stops = set(stop_ids)
    while True:
        scores = out.logits[0, -1].float()
        if temperature > 0:
            probs = torch.softmax(scores / temperature, dim=-1).cpu()
            token = int(torch.multinomial(probs, 1, generator=generator))
        else:
            token = int(scores.argmax())
        produced.append(token)
        if token in stops or len(produced) >= max_new_tokens:
            return produced
        out = target(input_ids=torch.tensor([[token]], device=device), use_cache=True,
                     **kv_cache(out))
