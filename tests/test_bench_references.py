"""The schedules the end-game cases of `make bench` stand beside (benchmarks/measure.py): what a
dispatcher reaches at zero overhead with moves, or knowing every length, bounded by the ideal."""
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import measure


def test_a_move_finishes_the_slow_servers_last_generation_on_the_free_fast_slot():
    times, slots, slow = [1.0, 4.0], [1, 1], [1.0, 2.0]
    # in order: the short one to the fast slot (ends at 1), the long one to the slow (ends at 8)
    assert measure.dynamic_makespan(times, slots, slow) == 8.0
    # at 1 the fast slot takes it over with 3.5 of its 4 seconds of work left: 1 + 3.5
    assert measure.moving_makespan(times, slots, slow) == 4.5
    # knowing the lengths: the long one first, on the fast slot; the short one on the slow
    assert measure.foreknowing_makespan(times, slots, slow) == 4.0
    assert measure.ideal_makespan(times, slots, slow) == 4.0


def test_equal_servers_gain_nothing_from_moves():
    times = [3.0, 1.0, 1.0, 1.0, 5.0, 2.0]
    assert measure.moving_makespan(times, [2, 1], [1.0, 1.0]) == measure.dynamic_makespan(
        times, [2, 1], [1.0, 1.0])


@settings(max_examples=200, deadline=None)
@given(times=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=60),
       servers=st.lists(st.tuples(st.integers(1, 4), st.sampled_from([1.0, 1.5, 2.0])),
                        min_size=1, max_size=4))
def test_every_schedule_lies_between_the_ideal_and_the_plain_dispatcher(times, servers):
    slots, slow = [n for n, _ in servers], [f for _, f in servers]
    ideal = measure.ideal_makespan(times, slots, slow)
    dynamic = measure.dynamic_makespan(times, slots, slow)
    moving = measure.moving_makespan(times, slots, slow)
    assert ideal <= moving * (1 + 1e-9) and moving <= dynamic * (1 + 1e-9)
    assert ideal <= measure.foreknowing_makespan(times, slots, slow) * (1 + 1e-9)
