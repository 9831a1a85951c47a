"""The time a job has left, from tokens: the output tokens it is expected to generate still, over
the tokens the fleet generates per second.

The request-rate ETA (prompts left over completions per second) is wrong exactly when it
matters: a run's first completions are its short outputs, and after a restart or a raised cap
the long ones are all still in flight, so the rate of completions says little about the time
left (the seed's run read 35 hours a minute after its restart, 26.7 two minutes later).

Tokens left = the prompts not yet sent × the expected length of an output, plus, for each
prompt in flight, the expected rest of its output given what it has generated so far. Both
come from one estimate of the job's length distribution: Kaplan-Meier over the ledger's 64-token
histogram of finished rows (a row cut at the cap is an output of exactly the cap: every prompt
of the job runs under it), with each prompt in flight a censored observation, at least as long
as what it has generated (its time since it was sent × its GPU's decode speed per request, at
most the cap). Counting the long outputs still in flight is what the completions alone miss.
The time is those tokens at the fleet's rate (what it generates now: progress.token_eta), then
the end, when each slot finishes what it holds (seconds_left).
"""
from __future__ import annotations

from typing import Iterable, Mapping

BUCKET = 64  # the ledger's histogram resolution (ledger.HIST_BUCKET_TOKENS)


def censored_buckets(in_flight_so_far: Iterable[float], cap: int) -> dict[int, tuple[int, float]]:
    """The outputs in flight by the bucket they have reached: {bucket: (count, tokens so far)}."""
    return censored_counted(((tokens, 1) for tokens in in_flight_so_far), cap)


def censored_counted(so_far: Iterable[tuple[float, int]], cap: int) -> dict[int, tuple[int, float]]:
    """censored_buckets of (tokens so far, how many outputs have that many)."""
    found: dict[int, tuple[int, float]] = {}
    for tokens, count in so_far:
        tokens = min(tokens, cap)
        bucket = int(tokens) // BUCKET * BUCKET
        n, total = found.get(bucket, (0, 0.0))
        found[bucket] = (n + count, total + tokens * count)
    return found


def length_distribution(finished: Mapping[int, int], censored: Mapping[int, tuple[int, float]],
                        cap: int) -> list[tuple[float, float]]:
    """The estimated length distribution as [(length, probability)], ascending, from the
    histogram of finished outputs {bucket lower edge: rows} and the outputs in flight
    (censored_buckets: each longer than what it has). A bucket's rows count at its middle, the
    cap's at the cap."""
    buckets = sorted(set(finished) | set(censored))
    at_risk = sum(finished.values()) + sum(n for n, _ in censored.values())
    alive, mass = 1.0, []
    for bucket in buckets:
        if at_risk <= 0:
            break
        ended = finished.get(bucket, 0)
        if ended:
            died = alive * ended / at_risk
            length = cap if bucket <= cap < bucket + BUCKET else min(bucket + BUCKET / 2, cap)
            mass.append((length, died))
            alive -= died
        # An output in flight leaves the risk set after the bucket it has reached.
        at_risk -= ended + censored.get(bucket, (0, 0.0))[0]
    if alive > 1e-9:  # outputs longer than any that ended: at the cap, the most they can be
        mass.append((float(cap), alive))
    return mass


def tokens_left(mass: list[tuple[float, float]], unsent: int,
                censored: Mapping[int, tuple[int, float]]) -> float:
    """Expected output tokens left: each prompt not yet sent an output of the expected length,
    each in flight the expected rest of one longer than its bucket's lower edge: O(buckets²),
    a few thousand steps at a cap of 4,096."""
    left = unsent * _mean_beyond(mass, -1.0)
    for bucket, (n, so_far) in censored.items():
        left += max(0.0, n * _mean_beyond(mass, bucket) - so_far)
    return left


def _mean_beyond(mass: list[tuple[float, float]], edge: float) -> float:
    longer = [(length, p) for length, p in mass if length > edge]
    weight = sum(p for _, p in longer)
    return sum(length * p for length, p in longer) / weight if weight > 0 else max(edge, 0.0)


def _survival(mass: list[tuple[float, float]], tokens: float) -> float:
    return sum(p for length, p in mass if length > tokens)


STEPS = 96  # the time grid of the end's integral


def seconds_left(mass: list[tuple[float, float]], unsent: int,
                 in_flight: Mapping[float, Mapping[int, tuple[int, float]]], rate: float,
                 waiting: Mapping[float, Mapping[int, tuple[int, float]]] | None = None,
                 moved_below: float | None = None,
                 paused: Mapping[int, tuple[int, float]] | None = None,
                 round_tokens: int | None = None) -> float:
    """The expected time until the last output ends. `unsent`: prompts not yet given to a GPU;
    `in_flight`: by GPU speed (output tokens/s of one request, grouped), the outputs decoding
    there (censored_buckets); `waiting`: by GPU speed, the prompts given to those GPUs that wait
    for a slot there (censored_buckets: one starting from nothing at 0 tokens, a generation
    going on from a round or a move at the tokens it holds); `rate`: the fleet's output
    tokens/s.

    Two phases. While prompts wait to be given, the fleet runs full: their tokens, and all but
    the final stretch of those in flight, go at `rate`. Then the end: each slot finishes the
    output it holds, and its share of its GPU's waiting prompts, and the run ends with the
    last: E[max] = integral of P(max > t) dt, from each slot's residual over its GPU's speed. A
    slot that takes a new prompt until the queue empties holds, at that moment, an output drawn
    by length (a longer one is more likely under way) and half done on average: its residual R
    has P(R > r) = E[(L - r)+] / E[L]. Once the queue is empty, each output in flight has its
    own: P(L - g > r | L > g).

    `moved_below`: the end game (take.lua) on a GPU slower than this speed: once none is
    pending, the faster GPUs take its waiting prompts and have the generations it runs moved to
    them as their slots free, so the others decode what it holds after their own queues, and,
    once the queue is empty, its outputs end at the fastest speed.
    `paused`: generations waiting in pending to go on from a round (censored_buckets), the rest
    of their output still to come before the end. `round_tokens`: the end game's rounds
    (window.round_cap): a request runs at most this much further, and one cut there goes on
    behind every prompt not yet started, so the requests the slots hold when the queue empties
    are the generations' last pieces (round_pieces), not whole outputs."""
    paused = paused or {}
    waiting = waiting or {}
    queued = {speed: sum(n for n, _ in groups.values()) for speed, groups in waiting.items()}
    known = merged([paused, *waiting.values()])  # what each one not decoding holds
    slots = {speed: sum(n for n, _ in groups.values()) for speed, groups in in_flight.items()}
    fastest = max((speed for speed, n in slots.items() if n), default=0.0)

    def end_speed(speed: float) -> float:
        return fastest if moved_below is not None and speed < moved_below else speed

    if not mass or rate <= 0:
        return 0.0
    if not any(slots.values()):  # nothing decoding now (servers stalled, held): no end to model
        return tokens_left(mass, unsent, known) / rate
    if unsent > 0 or paused:
        # what the slots hold when the queue empties: outputs, or in rounds their last pieces
        pieces = mass if not round_tokens else round_pieces(mass, round_tokens)
        mean = sum(length * p for length, p in pieces)
        residual_mean = sum(length * length * p for length, p in pieces) / (2 * mean) if mean \
            else 0
        # The end game leaves a GPU it moves from (moved_below) nothing: its waiting prompts and
        # the rest of what its slots hold are decoded by the others, after their own queues.
        kept = {speed: n for speed, n in slots.items()
                if n and (moved_below is None or speed >= moved_below)}
        handed = sum(queued.get(speed, 0) * mean + n * residual_mean
                     for speed, n in slots.items() if speed not in kept)
        capacity = sum(speed * n for speed, n in kept.items())
        # a slot's share of its GPU's waiting prompts, decoded after the piece it holds, and of
        # the work handed on from the GPUs moved from
        shift = {speed: queued.get(speed, 0) * mean / n + handed * speed / capacity
                 for speed, n in kept.items()}
        # tokens the end will spend: each slot's mean residual, E[L^2] / 2E[L], and the
        # prompts waiting for a slot on their GPU
        at_end = sum(slots.values()) * residual_mean + sum(queued.values()) * mean
        full_run = tokens_left(mass, unsent, merged([*in_flight.values(), known])) - at_end
        return max(0.0, full_run) / rate + _expected_max(_by_speed(
            (speed, n, lambda r, d=shift[speed]: _residual_after_queue(pieces, mean, r - d))
            for speed, n in kept.items()))
    mean = sum(length * p for length, p in mass)
    shift = {speed: queued.get(speed, 0) * mean / n for speed, n in slots.items() if n}
    return _expected_max(_by_speed(
        (end_speed(speed), n, lambda r, edge=bucket, g=so_far / n, d=shift.get(speed, 0):
         _residual_given(mass, edge, g, r - d))
        for speed, groups in in_flight.items() for bucket, (n, so_far) in groups.items()))


def round_pieces(mass: list[tuple[float, float]], round_tokens: int) -> list[tuple[float, float]]:
    """The requests that end a run in rounds, as a distribution [(length, probability)]: an
    output longer than a round is cut into rounds and each cut goes on behind the prompts not
    started, so what runs last are the pieces after the first, at most a round each. Outputs no
    longer than a round (none cut) end it whole."""
    pieces: dict[float, float] = {}
    for length, p in mass:
        done = round_tokens
        while length > done:
            piece = min(length - done, round_tokens)
            pieces[piece] = pieces.get(piece, 0.0) + p
            done += round_tokens
    if not pieces:
        return mass
    weight = sum(pieces.values())
    return sorted((length, p / weight) for length, p in pieces.items())


def _by_speed(members) -> dict[float, list]:
    """(speed, slots, tail) triples grouped by speed, as _expected_max takes them."""
    groups: dict[float, list] = {}
    for speed, n, tail in members:
        groups.setdefault(speed, []).append((n, tail))
    return groups


def merged(censored: Iterable[Mapping[int, tuple[int, float]]]) -> dict[int, tuple[int, float]]:
    """Censored buckets (censored_buckets) of several groups, added up."""
    out: dict[int, tuple[int, float]] = {}
    for groups in censored:
        for bucket, (n, so_far) in groups.items():
            m, total = out.get(bucket, (0, 0.0))
            out[bucket] = (m + n, total + so_far)
    return out


def _residual_after_queue(mass, mean: float, r: float) -> float:
    """P(R > r) for a slot's output when the queue empties: E[(L - r)+] / E[L]."""
    if r < 0:
        return 1.0
    return sum((length - r) * p for length, p in mass if length > r) / mean if mean else 0.0


def _residual_given(mass, edge: float, so_far: float, r: float) -> float:
    """P(L - g > r | L > edge), g the tokens it has (edge: its bucket's lower edge)."""
    if r < 0:
        return 1.0
    alive = _survival(mass, edge)
    return _survival(mass, so_far + r) / alive if alive > 0 else 0.0


def _expected_max(groups: Mapping[float, list]) -> float:
    """E[max over every slot of its residual tokens / its speed]: `groups` by speed, each a list
    of (slots, P(residual > r))."""
    longest = 0.0
    for speed, members in groups.items():
        for _, tail in members:
            # the residual is at most the longest length: find where the tail reaches 0
            r = 1.0
            while tail(r) > 0 and r < 1 << 24:
                r *= 2
            longest = max(longest, r / speed)
    step = longest / STEPS
    total = 0.0
    for k in range(STEPS):
        t = (k + 0.5) * step
        below = 1.0
        for speed, members in groups.items():
            for n, tail in members:
                below *= max(0.0, 1.0 - tail(t * speed)) ** n
        total += (1.0 - below) * step
    return total
