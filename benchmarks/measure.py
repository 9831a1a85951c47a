"""What the benchmark reads: the ideal makespan from the simulated model, the servers' own
counts (polled), and the CPU time each process spent."""
from __future__ import annotations

import heapq
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from dflash_dev.sim.lengths import chat_plan, greedy_makespan, service_seconds
from dflash_tasks.core.settings import Settings
from dflash_tasks.ingest.prompts import read_prompts

_TICK = os.sysconf("SC_CLK_TCK")


# -- the ideal ----------------------------------------------------------------------------------

def unit_service_times(dataset: Path, max_tokens: int, decode_tps: float) -> list[float]:
    """Each prompt's decode-slot time on a server of speed 1, priced exactly as the simulated
    server prices it (prefill of the prompt, then decoding of the completion). Kept beside the
    dataset once computed (tokenizing 16,000 prompts takes a few seconds)."""
    cache = dataset.with_name(f"{dataset.stem}.service-{max_tokens}-{decode_tps:g}.json")
    if cache.exists() and cache.stat().st_mtime >= dataset.stat().st_mtime:
        return json.loads(cache.read_text())
    out = []
    for p in read_prompts(dataset):
        plan = chat_plan(list(p.messages), max_tokens)
        out.append(service_seconds(plan.prompt_tokens, plan.completion_tokens, decode_tps=decode_tps))
    cache.write_text(json.dumps(out))
    return out


def ideal_makespan(times: list[float], slots: list[int], slow: list[float]) -> float:
    """A lower bound on any schedule: all the work spread over all slots at their speeds
    (server i does 1/slow[i] seconds of work per slot-second), or the longest single request
    on the fastest server. With equal servers: max(total / total slots, longest)."""
    capacity = sum(n / f for n, f in zip(slots, slow))
    return max(sum(times) / capacity, max(times) * min(slow))


def dynamic_makespan(times: list[float], slots: list[int], slow: list[float]) -> float:
    """A zero-overhead dispatcher in dataset order: each prompt to the first slot to free up
    anywhere. Not a bound, a reference: it shows the drain at the end that no dispatcher
    without foreknowledge of output lengths avoids."""
    free = [(0.0, f) for n, f in zip(slots, slow) for _ in range(n)]
    heapq.heapify(free)
    end = 0.0
    for t in times:
        at, f = heapq.heappop(free)
        done = at + t * f
        end = max(end, done)
        heapq.heappush(free, (done, f))
    return end


def moving_makespan(times: list[float], slots: list[int], slow: list[float]) -> float:
    """The dynamic dispatcher plus the end game's moves at zero cost: once every prompt has
    started, a slot that frees up takes the running generation of a slower server that would
    end last, if it ends sooner here. It knows how long the running generations still run
    (the project only guesses: the newest dispatched), never how long a pending prompt will be:
    the floor of any dispatcher that starts prompts in order, runs each to its end without
    foreknowledge of lengths, and moves what runs (rounds go below it: rounds_makespan)."""
    speed = [f for n, f in zip(slots, slow) for _ in range(n)]
    free = [(0.0, f, i) for i, f in enumerate(speed)]  # ties to the faster slot, as dynamic_makespan
    heapq.heapify(free)
    ends = [0.0] * len(speed)
    for t in times:
        at, f, i = heapq.heappop(free)
        ends[i] = at + t * f
        heapq.heappush(free, (ends[i], f, i))
    return _moved_end(ends, speed)


def _moved_end(ends: list[float], speed: list[float]) -> float:
    """The last end once every prompt has started, each slot that frees up taking the running
    generation of a slower one that would end last, if it ends sooner there (zero cost)."""
    events = sorted((e, i) for i, e in enumerate(ends))
    heapq.heapify(events)
    while events:
        now, i = heapq.heappop(events)
        if ends[i] != now:
            continue  # this slot took a generation since; its new end is queued
        running = [j for j in range(len(speed)) if speed[j] > speed[i] and ends[j] > now]
        if not running:
            continue
        j = max(running, key=ends.__getitem__)
        moved_end = now + (ends[j] - now) / speed[j] * speed[i]
        if moved_end < ends[j]:
            ends[i], ends[j] = moved_end, now
            heapq.heappush(events, (moved_end, i))
            heapq.heappush(events, (now, j))  # the slower slot is free: it may take from a slower one still
    return max(ends)


def rounds_makespan(times: list[float], slots: list[int], slow: list[float], round_s: float,
                    rounds_below: float) -> float:
    """The project's end game at zero cost: a prompt started once fewer than rounds_below are
    pending runs one round (round_s at speed 1) at a time, and one cut there goes on behind the
    prompts not started yet, whichever slot frees up first (the oldest cut first); then the
    moves of moving_makespan. Knows no length in advance."""
    speed = [f for n, f in zip(slots, slow) for _ in range(n)]
    free = [(0.0, f, i) for i, f in enumerate(speed)]
    heapq.heapify(free)
    ends = [0.0] * len(speed)
    fresh = list(reversed(times))  # popped from the end: dataset order
    cut: list[tuple[float, float, int]] = []  # (ready at, work left, order): oldest first
    order = 0
    while fresh or cut:
        at, f, i = heapq.heappop(free)
        if fresh:
            left = fresh.pop()
        elif cut[0][0] <= at:
            _, left, _ = heapq.heappop(cut)
        else:  # nothing to start before the next round is ready
            heapq.heappush(free, (cut[0][0], f, i))
            continue
        run = min(left, round_s) if len(fresh) < rounds_below else left
        ends[i] = at + run * f
        heapq.heappush(free, (ends[i], f, i))
        if run < left:
            order += 1
            heapq.heappush(cut, (ends[i], left - run, order))
    return _moved_end(ends, speed)


def foreknowing_makespan(times: list[float], slots: list[int], slow: list[float]) -> float:
    """A dispatcher that knows every output's length before it starts (the LPT rule: longest
    first, each to the slot where it ends soonest). Not reachable without that knowledge: it
    shows how much of the ideal is foreknowledge."""
    speed = [f for n, f in zip(slots, slow) for _ in range(n)]
    by_speed: dict[float, list[float]] = {f: [0.0] * speed.count(f) for f in set(speed)}
    for heap in by_speed.values():
        heapq.heapify(heap)
    for t in sorted(times, reverse=True):
        f = min(by_speed, key=lambda f: by_speed[f][0] + t * f)
        heapq.heapreplace(by_speed[f], by_speed[f][0] + t * f)
    return max(max(heap) for heap in by_speed.values())


def static_makespan(times: list[float], slots: list[int], slow: list[float]) -> float:
    """The baseline's schedule without its client's overhead: prompt i to server i mod n up
    front, each server's share in order over its own slots."""
    n = len(slots)
    return max(greedy_makespan([t * slow[i] for t in times[i::n]], slots[i]) for i in range(n))


def round_figures(r, decode_tps: float) -> dict:
    """A round's length in seconds of speed-1 work, and how few prompts pending begin the
    rounds: the deployed settings, over the concurrency the GPU workers registered (each task
    reckons its own concurrency times the job's GPUs: the same with equal workers)."""
    from dflash_tasks.core.keys import WORKERS
    s = Settings()
    concurrency = sum(json.loads(v)["concurrency"] for v in r.hvals(WORKERS))
    return {"round_s": s.endgame_round_tokens / decode_tps,
            "rounds_below": s.endgame_rounds_depth * concurrency}


END_GAME_COUNTERS = ("migrated", "migrated_tokens", "rounds", "round_tokens")


def end_game_counters(counters: dict[str, int]) -> dict[str, int]:
    """The end game's moves and rounds from a job's counters (hand_over.lua, next_round.lua)."""
    return {name: counters.get(name, 0) for name in END_GAME_COUNTERS}


def references(times: list[float], slots: list[int], slow: list[float], ideal: float, *,
               round_s: float, rounds_below: float) -> dict:
    """The computed schedules a case's makespan stands beside, each as a ratio to the ideal:
    the dynamic dispatcher without moves, with the end game's moves, in rounds with moves (the
    project's end game at zero cost), with foreknowledge of every length, and the seed-style
    static split."""
    return {"dynamic_ref": dynamic_makespan(times, slots, slow) / ideal,
            "moving_ref": moving_makespan(times, slots, slow) / ideal,
            "rounds_ref": rounds_makespan(times, slots, slow, round_s, rounds_below) / ideal,
            "foreknowing_ref": foreknowing_makespan(times, slots, slow) / ideal,
            "static_ref": static_makespan(times, slots, slow) / ideal}


# -- the servers' own counts --------------------------------------------------------------------

@dataclass
class ServerSeries:
    url: str
    samples: list[tuple[float, float, int, int]] = field(default_factory=list)  # now, busy_live, running, queued
    final: dict | None = None

    def busy_at(self, t: float) -> float:
        """Busy slot-seconds up to time t, interpolated between samples (busy time grows at the
        rate of the running requests, so the error is at most a sample interval of change)."""
        s = self.samples
        if not s or t <= s[0][0]:
            return s[0][1] if s else 0.0
        for (t0, b0, *_), (t1, b1, *_) in zip(s, s[1:]):
            if t0 <= t <= t1:
                return b0 + (b1 - b0) * (t - t0) / (t1 - t0) if t1 > t0 else b1
        return s[-1][1]


class ServerPoller:
    """Polls /sim/stats of some servers every `interval` seconds on a thread of its own."""

    def __init__(self, urls: list[str], interval: float = 0.25):
        self.series = [ServerSeries(u) for u in urls]
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._client = httpx.Client(timeout=10.0)

    def __enter__(self) -> "ServerPoller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for s in self.series:
            s.final = self._client.get(s.url + "/sim/stats").json()
        self._client.close()

    def save(self, path: Path) -> None:
        """Every server's samples and final stats, for a look after the run (--keep)."""
        path.write_text(json.dumps({s.url: {"samples": s.samples, "final": s.final}
                                    for s in self.series}))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            for s in self.series:
                try:
                    st = self._client.get(s.url + "/sim/stats").json()
                except httpx.HTTPError:
                    continue
                s.samples.append((st["now"], st["busy_slot_seconds_live"], st["running"], st["queued"]))


@dataclass
class RunFigures:
    makespan: float
    first_request: float
    last_finished: float
    drain_start: float        # the last time any request got a slot: no work waited anywhere after it
    occupancy: float          # busy slot-seconds / slot-seconds, first request to drain_start
    service_sum: float        # the servers' own total service seconds
    requests: int


def figures(series: list[ServerSeries]) -> RunFigures:
    finals = [s.final for s in series]
    first = min(f["first_request_at"] for f in finals if f["first_request_at"])
    last = max(f["last_finished_at"] for f in finals if f["last_finished_at"])
    drain = max(f["last_started_at"] for f in finals if f["last_started_at"])
    busy = sum(s.busy_at(drain) for s in series)
    slots = sum(f["slots"] for f in finals)
    return RunFigures(makespan=last - first, first_request=first, last_finished=last,
                      drain_start=drain, occupancy=busy / (slots * (drain - first)),
                      service_sum=sum(f["service_seconds_sum"] for f in finals),
                      requests=sum(f["requests"] for f in finals))


def ramp_s(series: list[ServerSeries]) -> float:
    """Seconds of the whole system's slots lost while the run fills them at its start: each
    server's idle slot-seconds from the first request anywhere until it first runs a full
    batch, over all slots (Celery delivering the first windows; a fixed cost, which weighs in a
    round of seconds and not in a day's run)."""
    first = min(s.final["first_request_at"] for s in series if s.final["first_request_at"])
    idle, slots = 0.0, 0
    for s in series:
        full, prev = s.final["slots"], None
        slots += full
        for now, _, running, _ in s.samples:
            if now < first:
                continue
            if prev is not None:
                idle += (full - prev[1]) * (now - prev[0])
            if running >= full:
                break
            prev = (now, running)
    return idle / slots


# -- CPU time per process -----------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


class CpuMeter:
    """CPU seconds spent by named processes between start() and stop()."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids
        self.start_at: dict[str, float] = {}
        self.used: dict[str, float] = {}

    def start(self) -> "CpuMeter":
        self.start_at = {n: cpu_seconds(p) for n, p in self.pids.items()}
        self.wall0 = time.monotonic()
        return self

    def stop(self) -> dict[str, float]:
        self.wall = time.monotonic() - self.wall0
        self.used = {n: cpu_seconds(p) - self.start_at[n] for n, p in self.pids.items()}
        return self.used

    def grouped(self) -> dict[str, float]:
        """CPU seconds per kind of process (sim0..3 -> sim, worker0..3 -> worker)."""
        out: dict[str, float] = {}
        for name, used in self.used.items():
            kind = process_kind(name)
            out[kind] = out.get(kind, 0.0) + used
        return out


def process_kind(name: str) -> str:
    """A process's kind from its name: "worker3" and "node2/worker3" are workers."""
    return name.rsplit("/", 1)[-1].rstrip("0123456789")


def machine_cpu_seconds() -> float:
    """CPU seconds the whole machine spent busy (all processes, /proc/stat)."""
    parts = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = list(map(int, parts))
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values[:8]) - idle) / _TICK


def machine_description() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    return f"{os.cpu_count()} CPUs ({model}), {mem_gb:.0f} GiB RAM"
