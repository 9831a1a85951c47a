"""Does an output end in a repetition loop? A stretch of token ids repeated back to back at its
tail, until the cap cut it: the row's `metadata.loop`, {"period", "repeats", "tokens"}.

A thinking model runs to the cap for two reasons: it is still reasoning, or it has fallen into a
loop. The literature on degenerate repetition says how to tell them apart and why the second is
not worth continuing. Holtzman et al. (2020, "The Curious Case of Neural Text Degeneration")
and Welleck et al. (2020, "Neural Text Generation with Unlikelihood Training") measure it as
repeated n-grams; Xu et al. (2022, "Learning to Break the Loop") show that it is
self-reinforcing: each repetition of a sentence makes the next more likely, until the model
copies it with near certainty. So a loop that has run to the cap is an exact repetition at its
tail, and more tokens buy more copies of it.

The test, on the response's ids, in one pass (O(length), once per row when it is recorded): the
longest suffix with a period p (each id equals the one p before it) such that

- p <= MAX_PERIOD tokens: a sentence to a long paragraph of reasoning repeated; a longer stretch
  repeated is rarer and less sure (and costs nothing to miss: the row is only continued);
- the suffix holds at least MIN_REPEATS whole copies: three copies back to back is the point at
  which Xu et al. find the model keeps repeating, and one more keeps a list or table that
  happens to repeat an item twice from being named;
- it covers at least MIN_TOKENS tokens: a closing run of newlines or `====` is a few tokens, not
  a loop worth a row.

Natural text never repeats hundreds of tokens exactly, back to back, four times: the false
positives of this test are nil in practice, and its misses are loops still short at the cap
(a loop begun in the last few hundred tokens), which a continuation then exposes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

MAX_PERIOD = 1024
MIN_REPEATS = 4
MIN_TOKENS = 128


@dataclass(frozen=True, slots=True)
class Loop:
    period: int  # tokens in one copy
    tokens: int  # tokens of the periodic tail (the loop, its last copy maybe cut short)

    @property
    def repeats(self) -> float:
        return self.tokens / self.period

    def as_metadata(self) -> dict:
        return {"period": self.period, "repeats": round(self.repeats, 1), "tokens": self.tokens}


def tail_loop(ids: Sequence[int], *, max_period: int = MAX_PERIOD,
              min_repeats: int = MIN_REPEATS, min_tokens: int = MIN_TOKENS) -> Loop | None:
    """The longest periodic tail of `ids` that is a loop by the thresholds above, or None.

    The prefix function (Knuth-Morris-Pratt) of the reversed ids gives, for each suffix of
    length n, its longest border b, and so its smallest period n - b: one pass, whatever the
    period."""
    reversed_ids = list(reversed(ids))
    border = [0] * len(reversed_ids)
    found: Loop | None = None
    k = 0
    for i in range(1, len(reversed_ids)):
        token = reversed_ids[i]
        while k and token != reversed_ids[k]:
            k = border[k - 1]
        if token == reversed_ids[k]:
            k += 1
        border[i] = k
        length = i + 1
        period = length - k
        if period <= max_period and length >= min_tokens and length >= min_repeats * period:
            found = Loop(period, length)
    return found


def loop_metadata(response_ids: Sequence[int] | None) -> dict | None:
    """The row's `metadata.loop`: None when its output does not end in a loop (or its ids are
    not known)."""
    if not response_ids:
        return None
    loop = tail_loop(response_ids)
    return loop.as_metadata() if loop else None


def is_looping(meta: dict) -> bool:
    """Whether a row's metadata marks its output as ending in a loop."""
    return bool(meta.get("loop"))
