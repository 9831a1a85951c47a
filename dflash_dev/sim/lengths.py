"""The simulated model's deterministic output lengths, and what they cost in GPU time.

A prompt's natural output length (the tokens until it stops by itself) is a pure function of its
prompt ids: lognormal with the given median, its sigma chosen so that P(length > 4096) equals
`p_over_4096` (about 18% in the real run this project was sized from), drawn from the prompt's
blake2b key. Same prompt, same length, on any server and in any run, so tests, the demo and the
benchmark can predict every output without running a server.

The benchmark computes a run's ideal makespan from `chat_plan` + `service_seconds` +
`ideal_makespan`, exactly as the server itself prices a request.
"""
from __future__ import annotations

import hashlib
import heapq
import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist
from typing import Iterable, Sequence

from dflash_dev.sim import tokens

_NORMAL = NormalDist()
_MIN_THINKING_TOKENS = 4  # <think>, one reasoning word, </think>, <|im_end|>


@lru_cache(maxsize=64)
def sigma_for(median: float, p_over_4096: float) -> float:
    """The lognormal sigma for which P(length > 4096) = p_over_4096 at this median."""
    if not 0.0 < p_over_4096 < 1.0:
        raise ValueError(f"p_over_4096 must be in (0, 1), got {p_over_4096}")
    if median <= 0:
        raise ValueError(f"median must be positive, got {median}")
    z = _NORMAL.inv_cdf(1.0 - p_over_4096)
    sigma = math.log(4096.0 / median) / z if z != 0 else float("nan")
    if not (sigma > 0 and math.isfinite(sigma)):
        raise ValueError(f"no lognormal has median {median} and P(>4096) = {p_over_4096}")
    return sigma


def _unit(key: bytes, lo: int, hi: int) -> float:
    """A number in (0, 1) from bytes lo..hi of a prompt key."""
    return (int.from_bytes(key[lo:hi], "big") + 0.5) / float(1 << (8 * (hi - lo)))


def natural_length(prompt_key: bytes, median: float = 1800.0, p_over_4096: float = 0.18) -> int:
    """The natural output length (>= 1) of the prompt with this key (see `tokens.prompt_key`)."""
    z = _NORMAL.inv_cdf(_unit(prompt_key, 0, 8))
    return max(1, round(median * math.exp(sigma_for(median, p_over_4096) * z)))


def reasoning_share(prompt_key: bytes) -> float:
    """The share of a thinking-mode response spent reasoning: 0.60 to 0.90, 0.75 on average."""
    return 0.60 + 0.30 * _unit(prompt_key, 8, 10)


def layout_for(prompt_key: bytes, natural: int, thinking: bool,
               byte_level: bool = False, head: tuple[int, ...] = ()) -> tokens.Layout:
    """How a response of `natural` tokens is cut into reasoning and answer (see tokens.Layout).

    Thinking mode needs at least 4 tokens (the two markers, one reasoning word, `<|im_end|>`), so a
    shorter natural length is raised to 4 there.
    """
    offset = int.from_bytes(prompt_key[10:14], "big")
    if not thinking:
        return tokens.Layout(False, 0, natural - 1, offset, byte_level, head)
    body = max(natural, _MIN_THINKING_TOKENS) - 3  # reasoning + answer words
    reasoning = min(max(1, round(reasoning_share(prompt_key) * body)), max(1, body - 1))
    return tokens.Layout(True, reasoning, body - reasoning, offset, byte_level, head)


@dataclass(frozen=True)
class ResponsePlan:
    """Everything the simulated model will say to one prompt."""

    key: bytes
    prompt_tokens: int
    layout: tokens.Layout

    @property
    def natural_tokens(self) -> int:
        """Completion tokens when nothing caps the output (finish_reason "stop")."""
        return self.layout.length

    def outcome(self, start: int, max_new_tokens: int) -> tuple[int, str]:
        """(tokens generated, finish_reason) when generating from position `start` with a cap."""
        remaining = max(0, self.layout.length - start)
        if remaining <= max_new_tokens:
            return remaining, "stop"
        return max_new_tokens, "length"


def loop_of(key: bytes, loop_share: float) -> tuple[int, int] | None:
    """(first word, period) of the degenerate loop the output of this key falls into, for a
    share `loop_share` of keys; None for the others. It begins after 200 to 3,000 words and
    repeats 16 to 255 words: cut at a 4,096-token cap, at least four copies of it."""
    if loop_share <= 0:
        return None
    drawn = hashlib.blake2b(key + b"loop", digest_size=12).digest()
    if _unit(drawn, 0, 4) >= loop_share:
        return None
    return 200 + int(2800 * _unit(drawn, 4, 8)), 16 + int(240 * _unit(drawn, 8, 12))


def plan_response(prompt_ids: Sequence[int], thinking: bool, *, median: float = 1800.0,
                  p_over_4096: float = 0.18, fixed_tokens: int = 0,
                  byte_level: bool = False, salt: int | None = None,
                  loop_share: float = 0.0) -> ResponsePlan:
    """The plan for a rendered prompt; `fixed_tokens` > 0 makes every natural length that long;
    `byte_level`: the byte-level tokenizer's output (tokens.py); `salt`: one of the prompt's
    sampled outputs (its own length and words), None: the one a greedy request gets, always the
    same. A sampled output says its salt as its first two words, so that a continuation on any
    server reads it back from the ids (salt_of) and goes on with the same output. A share
    `loop_share` of outputs fall into a loop (loop_of) and never end: every cap cuts them."""
    key = tokens.prompt_key(prompt_ids)
    head: tuple[int, ...] = ()
    if salt is not None:
        key = hashlib.blake2b(key + salt.to_bytes(8, "big"), digest_size=16).digest()
        head = (salt % tokens.VOCAB, salt // tokens.VOCAB)
    if loop := loop_of(key, loop_share):
        forever = 1 << 40
        layout = tokens.Layout(thinking, forever, forever, int.from_bytes(key[10:14], "big"),
                               byte_level, head, loop)
        return ResponsePlan(key, len(prompt_ids), layout)
    natural = fixed_tokens if fixed_tokens > 0 else natural_length(key, median, p_over_4096)
    return ResponsePlan(key, len(prompt_ids), layout_for(key, natural, thinking, byte_level, head))


def salt_of(response_ids: Sequence[int]) -> int | None:
    """The salt a sampled output's first two words say (plan_response); None before both."""
    words = [i for i in response_ids[:8] if i < tokens.VOCAB][:2]
    return words[0] + tokens.VOCAB * words[1] if len(words) == 2 else None


@dataclass(frozen=True)
class ChatOutcome:
    prompt_tokens: int
    completion_tokens: int
    natural_tokens: int
    finish_reason: str  # "stop" or "length"
    reasoning_tokens: int
    loop: tuple[int, int] | None = None  # (first word, period) of the loop it falls into


def chat_plan(messages: Sequence[dict], max_tokens: int | None = None, *, enable_thinking: bool = True,
              median: float = 1800.0, p_over_4096: float = 0.18, fixed_tokens: int = 0,
              context_length: int = 40960, loop_share: float = 0.0) -> ChatOutcome:
    """What the simulated server answers to this chat request (same parameters as its options)."""
    plan = plan_response(tokens.render_chat(messages, enable_thinking), enable_thinking,
                         median=median, p_over_4096=p_over_4096, fixed_tokens=fixed_tokens,
                         loop_share=loop_share)
    cap = context_length - plan.prompt_tokens if max_tokens is None else max_tokens
    completion, finish = plan.outcome(0, cap)
    return ChatOutcome(plan.prompt_tokens, completion, plan.natural_tokens, finish,
                       plan.layout.reasoning_tokens(completion), plan.layout.loop)


def service_seconds(prompt_tokens: int, completion_tokens: int, *, decode_tps: float = 2000.0,
                    prefill_tps: float = 200000.0, slow_factor: float = 1.0,
                    cached_tokens: int = 0) -> float:
    """How long one request holds a decode slot: prefill of the uncached prompt, then decoding."""
    uncached = max(0, prompt_tokens - cached_tokens)
    return (uncached / prefill_tps + completion_tokens / decode_tps) * slow_factor


def ideal_makespan(service_times: Iterable[float], slots: int) -> float:
    """A lower bound on any schedule's makespan: all slots always busy, or the longest request."""
    total = longest = 0.0
    for s in service_times:
        total += s
        longest = max(longest, s)
    return max(total / slots, longest)


def greedy_makespan(service_times: Iterable[float], slots: int) -> float:
    """Makespan when requests, all ready at t=0, take the first free slot in the given order."""
    free_at = [0.0] * slots
    for s in service_times:
        heapq.heapreplace(free_at, free_at[0] + s)
    return max(free_at)
