"""The one percentile rule (ledger/histogram.py): nearest rank over a tally, and the output-length
histogram's percentile capped at the job's max_tokens, as progress.json, `manage.py stats` and the
quality gate report them."""
from __future__ import annotations

from collections import Counter

from dflash_tasks.ledger import HIST_BUCKET_TOKENS
from dflash_tasks.ledger.histogram import bucket_value, length_percentile, nearest_rank, rank
from dflash_tasks.output.stats import histogram_percentiles, percentile


def test_nearest_rank_is_the_smallest_value_whose_cumulative_count_reaches_ceil_q_n():
    assert [rank(q, 10) for q in (0, 0.05, 0.1, 0.11, 0.5, 0.9, 0.99, 1)] == [1, 1, 1, 2, 5, 9, 10, 10]
    tally = {30: 1, 10: 4, 20: 5}  # 10 values: 10 ×4, 20 ×5, 30 ×1
    assert [nearest_rank(tally, q) for q in (0, 0.4, 0.41, 0.9, 0.91, 1)] == [10, 10, 20, 20, 30, 30]
    assert nearest_rank({}, 0.5) is None and nearest_rank({64: 0}, 0.5) is None
    # An emptied bucket (a regenerated row moved out of it) is never a percentile.
    assert nearest_rank({0: 2, 64: 0, 128: 2}, 0.5) == 0
    assert nearest_rank({0: 2, 64: 0, 128: 2}, 0.75) == 128


def test_the_same_rule_over_a_list_a_tally_and_a_histogram():
    values = sorted([3, 3, 7, 9, 12, 12, 12, 40, 41, 100, 101])
    for q in (1, 10, 50, 90, 99, 100):
        assert percentile(values, q) == nearest_rank(Counter(values), q / 100), q


def test_a_length_percentile_reports_the_cap_for_the_bucket_that_holds_it():
    cap = 300  # in the bucket 256..319
    assert HIST_BUCKET_TOKENS == 64
    assert [bucket_value(b, cap) for b in (0, 192, 256, 320)] == [0, 192, 300, 320]
    assert bucket_value(256, None) == 256 and bucket_value(256, 256) == 256
    hist = {0: 1, 64: 5, 256: 4}  # four rows truncated at the cap
    assert length_percentile(hist, 0.5, cap) == 64
    assert length_percentile(hist, 0.9, cap) == 300
    assert length_percentile(hist, 0.9, None) == 256
    assert length_percentile({}, 0.5, cap) is None
    assert histogram_percentiles(hist, cap) == {"count": 10, "p50": 64, "p90": 300, "p99": 300,
                                                "max": 300}
    assert histogram_percentiles({}, cap) == {"count": 0, "p50": 0, "p90": 0, "p99": 0, "max": 0}
    # A regenerate moves rows out of a bucket and leaves it at 0: no row is that long any more.
    emptied = {0: 1, 64: 5, 256: 0}
    assert histogram_percentiles(emptied, cap)["max"] == 64
