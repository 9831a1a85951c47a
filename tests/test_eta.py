"""The ETA from tokens (issue 41, item 3; dflash_tasks/output/eta.py, progress.token_eta) against a
fleet replayed in time: 16 GPUs of 40 decode slots, one at half speed, each holding 35 prompts
beyond its slots (a worker's concurrency above its server's slots: they wait there for a slot),
20,000 prompts of the seed's lengths (lognormal, median 1,800, 18% beyond a 4,096 cap), and the
deployed end game: rounds (window.round_cap: near the end a request runs at most 2,048 tokens
further, a cut generation going on behind every prompt not started), a faster GPU taking a
slower one's waiting prompts once none is pending, and at the very end moving the generation
the slower one started last (take.lua). Progress is read every minute as beat reads it (the
histogram of finished rows; per GPU the prompts in flight, when each was sent and the tokens it
held then, and its server's running requests and throughput; the generations paused between
rounds) and handed to the deployed `progress.token_eta`. From 10% of the run on, the token ETA
is within 10% of the time actually left; the request-rate formula, beside it, is off by more
than half near the end (the long outputs are the last to end)."""
from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from types import SimpleNamespace

import pytest

from dflash_dev.sim.lengths import natural_length
from dflash_tasks.core.settings import Settings
from dflash_tasks.dispatch import window
from dflash_tasks.output import eta, progress

CAP, GPUS, SLOTS, QUEUED, PROMPTS, WINDOW_S = 4096, 16, 40, 35, 20_000, 300.0
SPEED = 40.0  # output tokens/s of one request (a decode slot)


def replay(seed: int = 7, s: Settings | None = None):
    """(time, prompts done, token ETA, request ETA, time actually left) at each minute of a
    replayed run under settings `s` (the deployed ones by default)."""
    s = s or Settings()
    rng = random.Random(seed)
    lengths = [min(CAP, natural_length(rng.randbytes(16))) for _ in range(PROMPTS)]
    speeds = [SPEED / 2 if g == 0 else SPEED for g in range(GPUS)]
    names = [f"gpu{g}@replay" for g in range(GPUS)]
    pending: deque[tuple[int, int]] = deque((p, 0) for p in range(PROMPTS))  # (prompt, held)
    local: list[deque] = [deque() for _ in range(GPUS)]  # (prompt, held, sent at): for a slot
    running: list[dict] = [{} for _ in range(GPUS)]  # slot -> (prompt, held, sent, started, cap, n)
    ends: list[tuple[float, int, int, int]] = []  # (at, gpu, slot, request number)
    numbers = itertools.count()
    finished: dict[int, int] = {}
    done_log: deque[float] = deque()  # the window's completions
    completed = 0

    def faster(g: int, other: int) -> bool:
        return speeds[g] >= s.endgame_faster_ratio * speeds[other]

    def take(g: int, now: float) -> None:
        """The GPU's window topped up (take.lua): from pending, else, the end game, one waiting
        on another GPU, from a slower one's even while its own holds some; without rounds, a
        slower GPU leaves the last pending prompts to the faster ones (leave_to_faster)."""
        faster_take = sum((SLOTS + QUEUED) * (speeds[o] / speeds[g] - 1)
                          for o in range(GPUS) if faster(o, g))
        if not s.endgame_round_tokens and 0 < len(pending) <= faster_take:
            return  # without rounds the last prompts are left to the faster GPUs
        while len(running[g]) + len(local[g]) < SLOTS + QUEUED:
            if pending:
                prompt, held = pending.popleft()
                local[g].append((prompt, held, now))
                continue
            others = [o for o in range(GPUS) if o != g and local[o]
                      and (not local[g] or faster(g, o))]
            if not others:
                return
            prompt, held, _ = local[max(others, key=lambda o: len(local[o]))].pop()
            local[g].append((prompt, held, now))

    def start(g: int, slot: int, prompt: int, held: int, sent: float, now: float) -> None:
        cap = window.round_cap(s, CAP, held, len(pending), (SLOTS + QUEUED) * GPUS)
        number = next(numbers)
        running[g][slot] = (prompt, held, sent, now, cap, number)
        decoded = min(lengths[prompt], cap) - held
        heapq.heappush(ends, (now + decoded / speeds[g], g, slot, number))

    def fill(now: float) -> None:
        """Every free slot starts what its GPU holds; a GPU with a free slot and nothing waiting
        anywhere has the generation a slower GPU started last moved to it (take.lua)."""
        for g in range(GPUS):
            take(g, now)
            for slot in range(SLOTS):
                if slot in running[g]:
                    continue
                if local[g]:
                    start(g, slot, *local[g].popleft(), now)
                    continue
                slower = [o for o in range(GPUS) if faster(g, o) and running[o]]
                if pending or any(local) or not slower:
                    break
                o = min(slower, key=lambda o: speeds[o])
                from_slot = max(running[o], key=lambda k: running[o][k][3])
                prompt, held, _, started, _, _ = running[o].pop(from_slot)
                start(g, slot, prompt, int(held + (now - started) * speeds[o]), now, now)

    fill(0.0)
    samples, next_sample, first_end, last_end = [], 60.0, 0.0, 0.0
    while ends:
        at, g, slot, number = heapq.heappop(ends)
        if slot not in running[g] or running[g][slot][5] != number:
            continue  # moved away before it ended there
        while next_sample < at:  # a progress tick between two events
            now = next_sample
            while done_log and done_log[0] < now - WINDOW_S:
                done_log.popleft()
            if finished:
                reads = _reads(now, names, speeds, running, local, pending, finished, completed)
                hours, _ = progress.token_eta(reads, PROMPTS - completed, s)
                request_rate = len(done_log) / min(WINDOW_S, now - first_end)
                samples.append((now, completed, hours * 3600,
                                (PROMPTS - completed) / request_rate if request_rate else None))
            next_sample += 60.0
        prompt, _, _, _, cap, _ = running[g].pop(slot)
        last_end = at
        if lengths[prompt] > cap:  # cut at its round's end: it goes on behind the rest
            pending.append((prompt, cap))
        else:
            first_end = at if not completed else first_end
            completed += 1
            bucket = lengths[prompt] // eta.BUCKET * eta.BUCKET
            finished[bucket] = finished.get(bucket, 0) + 1
            done_log.append(at)
        fill(at)
    assert completed == PROMPTS
    return [(now, done, tokens, requests, last_end - now)
            for now, done, tokens, requests in samples]


def _reads(now, names, speeds, running, local, pending, finished, completed) -> progress.Reads:
    """What progress.read reads from Redis and the servers, from the replayed fleet."""
    sent_at, held_paused = {}, {}
    for prompt, held in pending:
        if held:
            held_paused[held] = held_paused.get(held, 0) + 1
    for g, name in enumerate(names):
        flight = [(sent, held, 1) for _, held, sent, *_ in running[g].values()]
        flight += [(sent, held, 1) for _, held, sent in local[g]]
        sent_at[name] = sorted(flight)
    counters = {"total": PROMPTS, "completed": completed,
                **{f"hist:{bucket}": n for bucket, n in finished.items()}}
    job = SimpleNamespace(status="running", turns="last", params=SimpleNamespace(max_tokens=CAP))
    return progress.Reads(
        job=job, gpus=names, now=now, window_start=0, window={}, counters=counters,
        pending=len(pending), unsealed_rows=0,
        in_flight_set={name: len(sent_at[name]) for name in names}, sent_at=sent_at,
        paused=held_paused, speeds=dict(zip(names, speeds)), retry_waiting={},
        workers={}, heartbeats={},
        servers={name: {"running": len(running[g]), "gen_throughput": len(running[g]) * speeds[g]}
                 for g, name in enumerate(names)},
        breakers={}, beat_seen=None, sealing_batch=None, storage_error={}, hold={},
        memory_hold=None, quality=None, updated_at=now)


@pytest.mark.parametrize("seed,round_tokens", [(7, None), (8, None), (9, None), (7, 0)])
def test_the_token_eta_is_within_ten_percent_from_a_tenth_of_the_run(seed, round_tokens):
    """Under the deployed settings, and with the end game's rounds turned off
    (DFLASH_ENDGAME_ROUND_TOKENS=0), where the slots hold whole outputs when the queue empties."""
    samples = replay(seed, Settings() if round_tokens is None
                     else Settings(endgame_round_tokens=round_tokens))
    end = samples[-1][0] + samples[-1][4]
    judged = [s for s in samples if s[0] >= 0.1 * end and s[4] > 30]
    assert len(judged) > 20
    token_errors = [abs(tokens - actual) / actual for _, _, tokens, _, actual in judged]
    request_errors = [abs(requests - actual) / actual for _, _, _, requests, actual in judged]
    assert max(token_errors) < 0.10, (f"replay(seed={seed}, round_tokens={round_tokens})", judged)
    assert max(request_errors) > 0.5 > 3 * max(token_errors)


def test_with_nothing_decoding_the_time_left_is_its_tokens_at_the_rate():
    """Servers that decode nothing now (stalled, or a test's hold) while prompts wait: the ETA is
    the tokens left at the fleet's last rate, never 0 (it read 0.0 with 958 prompts left)."""
    mass = eta.length_distribution({1024: 50, 2048: 50}, {}, CAP)
    idle = {SPEED: {}}
    assert eta.seconds_left(mass, 100, idle, 1000.0) == pytest.approx(
        eta.tokens_left(mass, 100, {}) / 1000.0)
    held = eta.seconds_left(mass, 80, idle, 1000.0,
                            waiting={SPEED: eta.censored_buckets([0.0] * 20, CAP)})
    assert held == pytest.approx(eta.tokens_left(mass, 100, {}) / 1000.0) and held > 100



def test_a_slower_gpus_work_goes_to_the_faster_gpus_that_decode():
    """The end game hands a slower GPU's queue and what its slots hold to the faster GPUs: the
    time left grows with that work, spread over their slots; and a GPU that decodes nothing (its
    server stalled) is neither the fastest the others are judged against nor given any."""
    s = Settings()
    finished = {1024: 50, 2048: 50}
    slow_running = {k: (k, 0, 0.0, 0.0, CAP, k) for k in range(SLOTS)}
    fast_running = {k: (k, 0, 0.0, 0.0, CAP, k) for k in range(SLOTS)}
    slow_queue = deque((SLOTS + k, 0, 5.0) for k in range(QUEUED))

    def left(speeds, running, local):
        names = [f"gpu{g}@t" for g in range(len(speeds))]
        reads = _reads(10.0, names, speeds, running, local, deque([(0, 0)] * 10), finished, 100)
        return progress.token_eta(reads, 10 + sum(map(len, running)) + sum(map(len, local)), s)[0]

    fast_alone = left([SPEED], [fast_running], [deque()])
    with_slow = left([SPEED, SPEED / 2], [fast_running, slow_running], [deque(), slow_queue])
    assert with_slow > fast_alone
    stalled = left([SPEED, SPEED / 2, 2 * SPEED], [fast_running, slow_running, {}],
                   [deque(), slow_queue, deque()])
    assert stalled == pytest.approx(with_slow)
