"""Percentiles over counted values: the ledger's output-length histogram (the counters
`hist:<lower edge>`, HIST_BUCKET_TOKENS wide, that complete.lua and reopen.lua keep) and any
other {value: count} tally (the latency buckets, the quality gate's loss-mask sums).

One rank rule for every percentile of the project, nearest rank: the q-quantile of n counted
values is the smallest value whose cumulative count reaches rank(q, n) = ceil(q * n), at least 1.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

from dflash_tasks.ledger import HIST_BUCKET_TOKENS


def rank(q: float, n: int) -> int:
    """The 1-based nearest rank of the q-quantile (q in 0..1) among n values: ceil(q * n), at
    least 1 (q = 0 is the smallest value)."""
    return max(1, math.ceil(q * n))


def nearest_rank(counts: Mapping[int, int], q: float) -> int | None:
    """The q-quantile (q in 0..1) of a tally {value: count}: the smallest value whose cumulative
    count reaches rank(q, n). None when it counts nothing."""
    n = sum(counts.values())
    if n <= 0:
        return None
    target, seen = rank(q, n), 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= target:
            return value
    return max(counts)


def bucket_value(bucket: int, max_tokens: int | None) -> int:
    """A length bucket as reported: its lower edge, except that the bucket holding the cap
    reports the cap (a truncated output is exactly max_tokens long)."""
    if max_tokens and bucket <= max_tokens < bucket + HIST_BUCKET_TOKENS:
        return max_tokens
    return bucket


def length_percentile(hist: Mapping[int, int], q: float, max_tokens: int | None) -> int | None:
    """The q-quantile (q in 0..1) of the output-length histogram {bucket lower edge: rows},
    capped at the job's max_tokens (bucket_value); None when it holds no row."""
    bucket = nearest_rank(hist, q)
    return None if bucket is None else bucket_value(bucket, max_tokens)
