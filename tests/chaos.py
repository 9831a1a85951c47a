"""The model-based chaos test's driver (issue 14): a real deployment (its own Redis with AOF
fsynced every second, S3 as moto's server behind a proxy that an action cuts for a while, two
simulated SGLang servers, two pinned workers, beat) driven through a
sequence of operator actions and faults drawn from a seed, with the invariants checked against a
model after every step and at the end.

A seeded driver rather than hypothesis' RuleBasedStateMachine: one sequence costs tens of seconds
of real processes, so shrinking is unaffordable, and the replay must work from a command line.
Step i of seed S draws from its own `random.Random(f"{S}/{i}")`, so a replay (`make chaos SEED=S
STEPS=N`) draws the same actions with the same parameters; which job an action targets is picked
among the jobs the model holds in a suitable state, which only timing (a job beat finished a
moment earlier or later) can change. The steps as they ran are printed and written as JSON on a
failure.

The model: per job, its ids (the union of every dataset enqueued into it) and its state, which
follows dflash_tasks.core.lifecycle.TRANSITIONS. The one transition no command makes, beat's
running -> done, may happen at any moment, so "running" in the model means running or done. A
command the table refuses must exit non-zero and change nothing; one it allows must exit 0 and
leave the state the table says.

Invariants, after each step (and while a fault is held, every half second):
- the job's total is exactly the model's ids;
- status accounts for every prompt: pending + in_flight + completed + failed == total (the
  snapshot reads its counts in one transaction: a mismatch is counted and reported, and one that
  lasts 3 s fails);
- the counters agree with the ledger: completed == |done set|, failed == |failed registry|;
- every id is shipped at most once, beyond the rows that `regenerate` replaced (the old row of a
  regenerated prompt stays in its batch; it must have the finish reason that was regenerated);
- a job reported done has every prompt completed or failed, nothing pending or in flight or
  unsealed, and every prompt shipped or in the failed registry.
At the end, once the faults stop: every job that is neither paused nor cancelled reaches done
within a bound, and the books are exact (check_books, allowing for regenerated rows); then every
job is resumed, its failures retried under a cap that fits, and all of them must finish with
every prompt in exactly one newest row. A deleted job must have no key left.
"""
from __future__ import annotations

import json
import random
import signal
import subprocess
import threading
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from itertools import permutations
from pathlib import Path

import httpx
import redis
from conftest import Cluster, write_jsonl
from s3support import MotoServer, TcpProxy, s3_env
from s3support import storage as s3_storage
from support import AofRedis, wait_until

from dflash_tasks.core import lifecycle
from dflash_tasks.core.keys import JobName
from dflash_tasks.core.lifecycle import CANCELLED, DONE, PAUSED, RUNNING

DELETED = "deleted"  # the model's own state: the job is gone

# Simulated servers: small contexts and short outputs so a job of 20-80 prompts takes seconds,
# a few transient faults (503, reset connections) so retries happen, and a context of 2048
# tokens so that a cap of 4096 makes every request a permanent 400 (the failed registry).
SIM_ARGS = ("--slots", "8", "--decode-tps", "600", "--context-length", "2048",
            "--median-tokens", "400", "--p-over-4096", "0.01", "--fail-503", "0.03",
            "--reset-rate", "0.01")
GOOD_CAPS = (256, 512, 1024, 1536)
BAD_CAP = 4096          # prompt + 4096 > the servers' 2048-token context: 400, no retry
GPUS = 2
MAX_JOBS = 4            # live jobs at once in a sequence

# Action kinds and their weights. FAULTS are the ones that break a process or a connection.
WEIGHTS = {
    "enqueue_new": 3.0, "enqueue_again": 2.0, "pause": 2.0, "resume": 2.0, "cancel": 1.0,
    "set": 2.0, "regenerate": 1.5, "retry_failed": 1.0, "delete": 1.0,
    "kill_worker": 1.5, "term_worker": 1.0, "server_down": 1.5, "redis_restart": 1.0,
    "beat_restart": 0.5, "s3_down": 1.0, "wait": 1.0,
}
# Concurrent mode (issue 27): bursts of operator commands at the same time as one another, beat's
# ticks and the workers' completions, and late duplicate deliveries. Every process widens the
# windows between a read and the write that depends on it (DFLASH_FAILPOINTS: random pauses at
# those points), S3 answers slowly, and the second server is slower.
CONCURRENT_FAILPOINTS = ",".join([
    "enqueue.before_apply=sleep:0-1.5", "set.before_apply=sleep:0-1",
    "state.before_apply=sleep:0-1", "tick.before_finish=sleep:0-1",
    "generate.after_read=sleep:0-0.2"])
SLOW_S3_S = 0.2
BURST_SHARE = 0.5       # of the steps of a concurrent sequence
BURST_WEIGHTS = {"enqueue_again": 2.0, "pause": 1.5, "resume": 1.5, "cancel": 1.0, "set": 2.0,
                 "regenerate": 1.0, "retry_failed": 1.0, "delete": 0.5, "late_duplicate": 2.0}
# What a command may answer when another one changed the job first (besides the lifecycle's
# "is <state>: ... not allowed"): a compare-and-set it lost, or a job deleted meanwhile (or
# before the command read it).
LOST_RACE = ("while this ran", "deleted meanwhile", "no job named")
# The fields of a job's config that a refused command must leave as they were.
SETTINGS_FIELDS = ("params", "gpus", "nodes", "dataset", "created_at")
FAULTS = {"kill_worker", "term_worker", "server_down", "redis_restart", "beat_restart", "s3_down"}


class ChaosFailure(AssertionError):
    pass


def accounted(snap: dict) -> int:
    """Every prompt status places somewhere (retry_waiting: retries waiting for their ETA, a
    field of its own since the Redis-restart recovery work; absent in older status output)."""
    return (snap["pending"] + snap["in_flight"] + snap.get("retry_waiting", 0)
            + snap["completed"] + snap["failed"])


@dataclass
class ChaosConfig:
    seed: int
    steps: int
    # Action kinds left out (e.g. one a known production bug makes useless for now).
    skip: frozenset = frozenset()
    # How long every job that is not paused or cancelled gets to reach done once faults stop.
    converge_s: float = 150.0
    # Bursts of concurrent commands and late duplicates, with widened windows (above).
    concurrent: bool = False
    # Deployed settings, except where a comment says why not. Cluster's own test defaults
    # shorten the retry backoff (0.2 s / 2 s); the chaos test puts the deployed policy back.
    settings: dict = field(default_factory=lambda: {
        "retry_base_s": "2.0", "retry_cap_s": "120.0", "max_retries": "20",
        "visibility_timeout_s": str(4 * 3600), "reap_after_s": str(5 * 3600),
    })


@dataclass
class JobModel:
    name: str
    ids: set[str]
    rows: list[dict]            # the dataset as last enqueued (re-enqueues extend it)
    state: str = RUNNING
    gpus: int = 1
    cap: int = 512
    caps: list[int] = field(default_factory=list)   # every cap the job has had, in order
    regenerations: int = 0
    regenerated_reasons: set[str] = field(default_factory=set)
    versions: int = 1
    # Where its first enqueue put the prompts' texts (`--bodies`); later enqueues add theirs in
    # Redis, so a job enqueued with "storage" mixes both.
    bodies: str = "redis"

    @property
    def bad_cap_ever(self) -> bool:
        return any(c >= BAD_CAP for c in self.caps)


@dataclass
class Step:
    n: int
    kind: str
    args: dict
    outcome: str = ""
    seconds: float = 0.0

    def line(self) -> str:
        args = " ".join(f"{k}={v}" for k, v in self.args.items())
        return f"{self.n:3d}. {self.kind:14} {args:44} -> {self.outcome} ({self.seconds:.1f}s)"


@dataclass(eq=False)
class Plan:
    """One action of a burst: a manage.py command (args), or a late duplicate (no args)."""
    kind: str
    job: "JobModel"
    args: list[str]
    lifecycle: str = ""
    cap: int | None = None            # the max_tokens it sets, if any
    rows: list[dict] = field(default_factory=list)   # an enqueue's dataset
    returncode: int | None = None
    output: str = ""

    def describe(self) -> str:
        return f"{self.kind} {self.job.name}" + (f" cap={self.cap}" if self.cap else "")

    def run(self, seq: "Sequence") -> None:
        if not self.args:
            self.output = seq.inject_duplicate(self.job)
            self.returncode = 0
            return
        result = seq.d.c.manage(*self.args, check=False)
        self.returncode, self.output = result.returncode, result.stdout + result.stderr

    def replaced_cap(self) -> int | None:
        """The cap a `set` reports it replaced ("max_tokens 512 -> 1024")."""
        for line in self.output.splitlines():
            words = line.split()
            if self.kind == "set" and words[:1] == ["max_tokens"] and "->" in words:
                return int(words[1])
        return None

    def reported_caps(self) -> str:
        return f"{' '.join(self.args)}: {self.replaced_cap()} -> {self.cap}"


@dataclass
class Stats:
    sequences: int = 0
    steps: int = 0
    kinds: Counter = field(default_factory=Counter)
    outcomes: Counter = field(default_factory=Counter)
    faults: Counter = field(default_factory=Counter)
    checks: Counter = field(default_factory=Counter)
    transient_identity_mismatches: int = 0
    prompts_generated: int = 0          # rows shipped (newest per id) at the end of sequences
    jobs: int = 0
    converge_seconds: list[float] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = asdict(self)
        for key in ("kinds", "outcomes", "faults", "checks"):
            d[key] = dict(sorted(getattr(self, key).items()))
        return d


def replay_command(seed: int, steps: int, skip: frozenset = frozenset(),
                   concurrent: bool = False) -> str:
    extra = f" SKIP={','.join(sorted(skip))}" if skip else ""
    return f"make chaos SEED={seed} STEPS={steps}{extra}" + (" CONCURRENT=1" if concurrent else "")


class Deployment:
    """Redis (AOF, everysec: the deployed setting), S3 (moto's server, behind a proxy the
    `s3_down` action cuts), two simulated servers, two workers, beat; every process through the
    Cluster fixture's helpers."""

    def __init__(self, tmp: Path, cfg: ChaosConfig):
        self.tmp = tmp
        self.redis = AofRedis(tmp, appendfsync="everysec")
        self.redis.start()
        self.moto = MotoServer(tmp / "logs" / "00-moto.log")
        self.moto.create_bucket()
        self.s3 = TcpProxy(self.moto.port, delay_s=SLOW_S3_S if cfg.concurrent else 0.0).start()
        self.s3_back: threading.Timer | None = None
        env, s3_settings = s3_env(self.s3.url)
        self.storage = s3_storage(self.moto.url)  # the checks read S3 directly, never cut
        self.c = Cluster(tmp, self.redis.url, **cfg.settings, **s3_settings)
        self.c.env.update(env)
        if cfg.concurrent:
            self.c.env["DFLASH_FAILPOINTS"] = CONCURRENT_FAILPOINTS
        for gpu in range(GPUS):
            slower = ("--slow-factor", "2") if cfg.concurrent and gpu == 1 else ()
            self.c.start_server(gpu, *SIM_ARGS, *slower, "--seed", str(cfg.seed * 10 + gpu))
        for gpu in range(GPUS):
            self.start_worker(gpu)
        self.c.start_beat()
        from dflash_tasks.core.settings import Settings
        self.settings = Settings(redis_url=self.redis.url, output_dir=self.c.output_dir,
                                 s3_uri=s3_settings["s3_uri"])

    def start_worker(self, gpu: int) -> None:
        proc = self.c.start_worker(gpu)
        # Registration is a key a predecessor may have left: wait for Celery's own "ready".
        wait_until(lambda: "ready." in proc.log() or not proc.alive(), timeout=90,
                   what=f"worker gpu{gpu} to be ready")
        if not proc.alive():
            raise ChaosFailure(f"worker gpu{gpu} exited at start:\n{proc.log()[-3000:]}")

    def r(self) -> redis.Redis:
        return self.c.r

    def read(self, fn, what: str = "a Redis read"):
        """fn(redis) with retries while Redis reloads its AOF after a restart."""
        deadline = time.monotonic() + 30
        while True:
            try:
                return fn(self.c.r)
            except (redis.ConnectionError, redis.BusyLoadingError, redis.TimeoutError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def s3_up(self) -> None:
        """End an S3 outage now (idempotent)."""
        if self.s3_back is not None:
            self.s3_back.cancel()
            self.s3_back = None
        if self.s3._listener is None:
            self.s3.start()

    def stop(self) -> None:
        try:
            self.c.stop()
        finally:
            if self.s3_back is not None:
                self.s3_back.cancel()
            self.s3.stop()
            self.moto.stop()
            self.redis.stop()


class Sequence:
    """One seeded sequence: a fresh deployment, `steps` actions, the final convergence."""

    def __init__(self, tmp: Path, cfg: ChaosConfig, stats: Stats, log=print):
        self.tmp = tmp
        self.cfg = cfg
        self.stats = stats
        self.log = log
        self.jobs: dict[str, JobModel] = {}
        self.steps: list[Step] = []
        self.next_job = 0
        self.d: Deployment | None = None

    # ------------------------------------------------------------------ running
    def run(self) -> None:
        self.stats.sequences += 1
        started = time.monotonic()
        try:
            self.d = Deployment(self.tmp, self.cfg)
            for n in range(1, self.cfg.steps + 1):
                self.step(n)
            self.finish()
        except Exception as exc:
            self.fail_report(exc)
            raise
        finally:
            if self.d is not None:
                self.d.stop()
            self.log(f"chaos seed {self.cfg.seed}: {len(self.steps)} steps, "
                     f"{time.monotonic() - started:.0f}s")

    def fail_report(self, exc: Exception) -> None:
        replay = replay_command(self.cfg.seed, self.cfg.steps, self.cfg.skip, self.cfg.concurrent)
        steps = [asdict(s) for s in self.steps]
        artifact = self.tmp / f"chaos-failure-{self.cfg.seed}.json"
        artifact.write_text(json.dumps({"seed": self.cfg.seed, "steps": self.cfg.steps,
                                        "replay": replay, "error": str(exc), "ran": steps}, indent=1))
        text = (f"\nCHAOS FAILURE, seed {self.cfg.seed} ({self.cfg.steps} steps)\n"
                f"replay: {replay}\nsteps as they ran:\n"
                + "\n".join(s.line() for s in self.steps)
                + f"\nerror: {exc}\nlogs: {self.tmp / 'logs'}\nsteps JSON: {artifact}\n")
        if not isinstance(exc, ChaosFailure):
            text += "".join(traceback.format_exception(exc))[-4000:]
        self.stats.failures.append({"seed": self.cfg.seed, "steps": self.cfg.steps,
                                    "replay": replay, "error": str(exc)[:4000],
                                    "ran": [s.line() for s in self.steps], "logs": str(self.tmp / "logs")})
        self.log(text)
        if not isinstance(exc, ChaosFailure):
            return
        exc.args = (f"{exc.args[0] if exc.args else ''}\n{text}",)

    def step(self, n: int) -> None:
        rng = random.Random(f"{self.cfg.seed}/{n}")
        if self.cfg.concurrent and rng.random() < BURST_SHARE:
            return self.burst(n, rng)
        kinds = [k for k in WEIGHTS if k not in self.cfg.skip]
        kind = rng.choices(kinds, weights=[WEIGHTS[k] for k in kinds])[0]
        draws = [rng.random() for _ in range(6)]   # a fixed number of draws per step
        step = Step(n, kind, {})
        self.steps.append(step)
        t0 = time.monotonic()
        getattr(self, f"do_{kind}")(step, draws)
        step.seconds = time.monotonic() - t0
        self.stats.steps += 1
        self.stats.kinds[step.kind] += 1
        self.stats.outcomes[step.outcome.split(":")[0]] += 1
        if step.kind in FAULTS:
            self.stats.faults[step.kind] += 1
        self.log(step.line())
        self.check_all(f"after step {n}")

    # ------------------------------------------------------------------ helpers
    def live(self, *states: str) -> list[JobModel]:
        return [j for _, j in sorted(self.jobs.items()) if j.state != DELETED
                and (not states or j.state in states)]

    def pick(self, draw: float, preferred: list[JobModel], anyjob_draw: float) -> JobModel | None:
        """A job in a state where the action is meaningful; one time in five any live job, so
        refusals are exercised too."""
        pool = preferred if preferred and anyjob_draw >= 0.2 else self.live()
        return pool[int(draw * len(pool))] if pool else None

    def actual_state(self, job: str) -> str | None:
        raw = self.d.read(lambda r: r.hget(f"dflash:{{{job}}}:config", "status"))
        return raw.decode() if raw is not None else None

    def config(self, job: str) -> dict:
        """The job's settings (not its status, nor dispatch's own bookkeeping fields)."""
        raw = self.d.read(lambda r: r.hgetall(f"dflash:{{{job}}}:config"))
        return {k.decode(): v.decode() for k, v in raw.items() if k.decode() in SETTINGS_FIELDS}

    def total(self, job: str) -> int:
        return int(self.d.read(lambda r: r.hget(f"dflash:{{{job}}}:counters", "total")) or 0)

    def observe(self, job: JobModel) -> str:
        """The job's state now, checked against the model (running may have become done)."""
        s = self.actual_state(job.name)
        self.stats.checks["state matches model"] += 1
        if s is None:
            raise ChaosFailure(f"job {job.name}: no config in Redis, the model holds {job.state}")
        if not (s == job.state or (job.state == RUNNING and s == DONE)):
            raise ChaosFailure(f"job {job.name} is {s}, the model holds {job.state}")
        job.state = s if s != DONE else RUNNING  # the model keeps done as running-or-done
        return s

    def command(self, step: Step, job: JobModel, lifecycle_cmd: str, args: list[str],
                adds_prompts: bool = False, may_refuse: str | None = None) -> bool:
        """Run a manage.py command that the lifecycle governs and check its outcome against
        the table, from the state observed just before (or done, which beat may reach in
        between). Returns whether it was accepted. A command that reads the shipped batches
        while S3 is cut stops with a clear error after doing part of its work (regenerate:
        what it read so far is queued again); it counts as accepted, partly."""
        s0 = self.observe(job)
        before_cfg = self.config(job.name)
        before_total = self.total(job.name)
        s3_down = self.d.s3._listener is None  # an outage may end while the command runs
        result = self.d.c.manage(*args, check=False)
        out = (result.stdout + result.stderr).strip()
        if "Traceback" in out:
            raise ChaosFailure(f"`manage.py {' '.join(args)}` crashed:\n{out[-3000:]}")
        starts = {s0, DONE} if s0 == RUNNING else {s0}
        allowed_in = {s for s in starts if lifecycle.allowed(lifecycle_cmd, s)}
        s1 = self.actual_state(job.name)
        self.stats.checks["command outcome matches lifecycle"] += 1
        partial = result.returncode == 1 and s3_down and "once the storage answers" in out
        if result.returncode == 0 or partial:
            if not allowed_in:
                raise ChaosFailure(
                    f"`manage.py {' '.join(args)}` exited 0 in state {s0}, which the lifecycle "
                    f"refuses (allowed in {sorted(lifecycle.TRANSITIONS[lifecycle_cmd])}); "
                    f"state now {s1}; output:\n{out[-1500:]}")
            if lifecycle_cmd == "delete":
                if s1 is not None:
                    raise ChaosFailure(f"delete of {job.name} exited 0 but its config is still there ({s1})")
                job.state = DELETED
            else:
                expected = {lifecycle.check(lifecycle_cmd, job.name, s) for s in allowed_in}
                if lifecycle_cmd == "enqueue" and DONE in allowed_in and not adds_prompts:
                    expected.add(DONE)
                closure = expected | ({DONE} if RUNNING in expected else set())
                if s1 not in closure:
                    raise ChaosFailure(f"`manage.py {' '.join(args)}` from {s0} left the job {s1}; "
                                       f"the lifecycle says {sorted(expected)}; output:\n{out[-1500:]}")
                job.state = RUNNING if s1 == DONE else s1
            step.outcome = "partly: S3 down" if partial else "ok"
            return True
        # refused: must be a state the table refuses it in, and nothing may have changed
        refusing = {s for s in starts if not lifecycle.allowed(lifecycle_cmd, s)}
        # A refusal that is not the lifecycle's (regenerate --continue of rows already at the
        # cap) is expected when its message says so; it must change nothing all the same.
        if not refusing and not (may_refuse and may_refuse in out):
            raise ChaosFailure(f"`manage.py {' '.join(args)}` exited {result.returncode} in state "
                               f"{s0}, which the lifecycle allows; output:\n{out[-2000:]}")
        after_cfg = self.config(job.name)
        self.stats.checks["refused command changed nothing"] += 1
        if s1 not in ({s0, DONE} if s0 == RUNNING else {s0}):
            raise ChaosFailure(f"refused `manage.py {' '.join(args)}` changed the state {s0} -> {s1}")
        if after_cfg != before_cfg or self.total(job.name) != before_total:
            raise ChaosFailure(f"refused `manage.py {' '.join(args)}` changed the job: config "
                               f"{before_cfg} -> {after_cfg}, total {before_total} -> "
                               f"{self.total(job.name)}")
        step.outcome = f"refused:{s1}"
        return False

    def dataset(self, job: JobModel) -> Path:
        path = self.tmp / "data" / f"{job.name}-v{job.versions}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_jsonl(path, job.rows)

    @staticmethod
    def prompt_rows(job: str, start: int, n: int) -> list[dict]:
        return [{"id": f"{job}-{i:03d}", "prompt": f"{job} question {i}: explain idea {i * 7919 % 997}."}
                for i in range(start, start + n)]

    def hold(self, seconds: float, what: str) -> None:
        """Let the deployment run for `seconds` (a fault lasting a while, or just time passing),
        checking the accounting identity twice a second meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for job in self.live():
                self.check_identity(job, what)
            time.sleep(0.5)

    # ------------------------------------------------------------------ actions
    def do_enqueue_new(self, step: Step, u: list[float]) -> None:
        if len(self.live()) >= MAX_JOBS:
            return self.do_wait(step, u)
        name = f"j{self.next_job}"
        self.next_job += 1
        n = 20 + int(u[0] * 61)
        gpus = 1 + int(u[1] * 2)
        cap = BAD_CAP if u[2] < 0.12 else GOOD_CAPS[int(u[3] * len(GOOD_CAPS))]
        bodies = "storage" if u[4] < 0.5 else "redis"
        job = JobModel(name, set(), self.prompt_rows(name, 0, n), gpus=gpus, cap=cap, caps=[cap],
                       bodies=bodies)
        job.ids = {row["id"] for row in job.rows}
        step.args = {"job": name, "prompts": n, "gpus": gpus, "cap": cap, "bodies": bodies}
        s3_down = self.d.s3._listener is None  # an outage may end while the command runs
        result = self.d.c.manage("enqueue", "--dataset", str(self.dataset(job)), "--job", name,
                                 "--gpus", str(gpus), "--max-output-tokens", str(cap),
                                 "--bodies", bodies, check=False)
        if result.returncode != 0:
            out = result.stdout + result.stderr
            # The prompts' texts cannot go to a cut S3: refused, and nothing may be left.
            if bodies == "storage" and s3_down and "not created" in out and "Traceback" not in out:
                self.check_deleted(job)
                step.outcome = "refused: S3 down"
                return
            raise ChaosFailure(f"enqueue of a new job failed:\n{result.stdout}\n{result.stderr}")
        self.jobs[name] = job
        self.stats.jobs += 1
        step.outcome = "ok"

    def do_enqueue_again(self, step: Step, u: list[float]) -> None:
        job = self.pick(u[0], self.live(RUNNING, PAUSED), u[1])
        if job is None:
            return self.do_wait(step, u)
        extra = int(u[2] * 16) if u[2] < 0.7 else 0
        gpus = 1 + int(u[3] * 2)
        cap = GOOD_CAPS[int(u[4] * len(GOOD_CAPS))] if u[5] < 0.5 else None
        step.args = {"job": job.name, "new_prompts": extra, "gpus": gpus, "cap": cap}
        rows = job.rows + self.prompt_rows(job.name, len(job.rows), extra)
        trial = JobModel(job.name, set(), rows, versions=job.versions + 1)
        args = ["enqueue", "--dataset", str(self.dataset(trial)), "--job", job.name,
                "--gpus", str(gpus)]
        if cap:
            args += ["--max-output-tokens", str(cap)]
        if self.command(step, job, "enqueue", args, adds_prompts=extra > 0):
            job.rows, job.versions, job.gpus = rows, trial.versions, gpus
            job.ids |= {row["id"] for row in rows}
            if cap:
                job.cap = cap
                job.caps.append(cap)

    def do_pause(self, step: Step, u: list[float]) -> None:
        self._simple(step, u, "pause", self.live(RUNNING), [])

    def do_resume(self, step: Step, u: list[float]) -> None:
        self._simple(step, u, "resume", self.live(PAUSED, CANCELLED), [])

    def do_cancel(self, step: Step, u: list[float]) -> None:
        self._simple(step, u, "cancel", self.live(RUNNING, PAUSED), ["--yes"])

    def do_delete(self, step: Step, u: list[float]) -> None:
        # A job whose prompts' texts are on a cut S3 is not deleted, and says so.
        job = self._simple(step, u, "delete", self.live(PAUSED, CANCELLED), ["--yes"],
                           may_refuse="nothing was deleted: run delete again when the storage answers")
        if job is not None and job.state == DELETED:
            self.check_deleted(job)

    def do_retry_failed(self, step: Step, u: list[float]) -> None:
        failing = [j for j in self.live(RUNNING, PAUSED) if j.bad_cap_ever]
        # the bad cap's failures are the prompts' own (too long for it): asked for by name
        self._simple(step, u, "retry-failed", failing or self.live(RUNNING, PAUSED),
                     ["--include-permanent"])

    def _simple(self, step: Step, u: list[float], cmd: str, preferred: list[JobModel],
                extra: list[str], may_refuse: str | None = None) -> JobModel | None:
        job = self.pick(u[0], preferred, u[1])
        if job is None:
            self.do_wait(step, u)
            return None
        step.args = {"job": job.name}
        self.command(step, job, cmd, [cmd, "--job", job.name, *extra], may_refuse=may_refuse)
        return job

    def do_set(self, step: Step, u: list[float]) -> None:
        job = self.pick(u[0], self.live(RUNNING, PAUSED, CANCELLED), u[1])
        if job is None:
            return self.do_wait(step, u)
        cap = BAD_CAP if u[2] < 0.15 else GOOD_CAPS[int(u[3] * len(GOOD_CAPS))]
        step.args = {"job": job.name, "cap": cap}
        if self.command(step, job, "set", ["set", "--job", job.name, "--max-output-tokens", str(cap)]):
            job.cap = cap
            job.caps.append(cap)

    def do_regenerate(self, step: Step, u: list[float]) -> None:
        job = self.pick(u[0], self.live(RUNNING, PAUSED), u[1])
        if job is None:
            return self.do_wait(step, u)
        # --continue after the cap was raised; a truncated row already at the cap makes the
        # command ask to raise it first (exit 2, nothing changed), which is right.
        cont = u[2] < 0.5 and job.cap < BAD_CAP and len(job.caps) > 1 \
            and job.cap > job.caps[-2]
        step.args = {"job": job.name, "continue": cont}
        args = ["regenerate", "--job", job.name, "--finish-reason", "length"]
        if cont:
            args.append("--continue")
        if self.command(step, job, "regenerate", args, may_refuse="raise it first"):
            job.regenerations += 1
            job.regenerated_reasons.add("length")

    def do_kill_worker(self, step: Step, u: list[float]) -> None:
        gpu = int(u[0] * GPUS)
        down = 0.5 + u[1] * 4
        step.args = {"gpu": gpu, "down_s": round(down, 1)}
        proc = self.d.c.workers[gpu]
        proc.kill()
        proc._log.close()
        self.hold(down, f"worker gpu{gpu} killed")
        self.d.start_worker(gpu)
        step.outcome = "restarted"

    def do_term_worker(self, step: Step, u: list[float]) -> None:
        gpu = int(u[0] * GPUS)
        down = 0.5 + u[1] * 3
        step.args = {"gpu": gpu, "down_s": round(down, 1)}
        proc = self.d.c.workers[gpu]
        proc._signal(signal.SIGTERM)
        try:
            # Requests here last about a second; warm shutdown should take seconds, not its
            # whole 240 s grace.
            proc.popen.wait(timeout=90)
            step.outcome = f"exited {proc.popen.returncode}"
        except subprocess.TimeoutExpired:
            self.stats.notes.append(f"seed {self.cfg.seed} step {step.n}: worker gpu{gpu} still "
                                    "running 90 s after SIGTERM; killed")
            proc.kill()
            step.outcome = "killed after 90s"
        proc._log.close()
        self.hold(down, f"worker gpu{gpu} stopped")
        self.d.start_worker(gpu)
        step.outcome += ", restarted"

    def do_server_down(self, step: Step, u: list[float]) -> None:
        gpu = int(u[0] * GPUS)
        seconds = round(2 + u[1] * 10, 1)
        step.args = {"gpu": gpu, "seconds": seconds}
        # A server still down from an earlier step has no control endpoint: wait for it first.
        self.wait_server(gpu)
        httpx.post(f"{self.d.c.url(gpu)}/sim/down", json={"seconds": seconds},
                   timeout=10).raise_for_status()
        step.outcome = "down"   # it comes back by itself; the next steps run meanwhile

    def do_redis_restart(self, step: Step, u: list[float]) -> None:
        down = round(u[0] * 3, 1)
        step.args = {"down_s": down}
        self.d.redis.crash()
        time.sleep(down)  # the outage itself: there is nothing to poll while Redis is down
        self.d.redis.start()
        step.outcome = "restarted"

    def do_s3_down(self, step: Step, u: list[float]) -> None:
        seconds = round(2 + u[0] * 13, 1)
        step.args = {"seconds": seconds}
        self.d.s3_up()  # one outage at a time
        self.d.s3.stop()  # refuses connections, cuts the open ones; moto keeps its objects
        self.d.s3_back = threading.Timer(seconds, self.d.s3_up)
        self.d.s3_back.start()
        step.outcome = "down"   # it comes back by itself; the next steps run meanwhile

    def do_beat_restart(self, step: Step, u: list[float]) -> None:
        step.args = {}
        self.d.c.beat.kill()
        self.d.c.beat._log.close()
        self.d.c.start_beat()
        step.outcome = "restarted"

    def do_wait(self, step: Step, u: list[float]) -> None:
        seconds = round(1 + u[5] * 3, 1)
        step.kind, step.args = "wait", {"seconds": seconds}
        self.hold(seconds, "waiting")
        step.outcome = "ok"

    # ------------------------------------------------------------------ concurrent bursts
    def burst(self, n: int, rng: random.Random) -> None:
        """2 or 3 actions at once, most often on one job (conflicts are the point): operator
        commands in subprocesses of their own, late duplicate deliveries injected into the
        GPUs' queues, while beat ticks and the workers complete. Each job touched is then
        checked against the lifecycle and the last parameters a command reported."""
        kinds = [k for k in BURST_WEIGHTS if k not in self.cfg.skip]
        size = rng.choice((2, 3))
        picked = rng.choices(kinds, weights=[BURST_WEIGHTS[k] for k in kinds], k=size)
        draws = [[rng.random() for _ in range(6)] for _ in range(size)]
        same_job = [rng.random() < 0.8 for _ in range(size)]
        focus = rng.random()
        # Now, or the moment the job's last prompt has its outcome and beat has yet to mark it
        # done: where a command that puts work back meets beat's final tick.
        at_finish = rng.random() < 0.35
        step = Step(n, "burst", {})
        self.steps.append(step)
        t0 = time.monotonic()
        live = self.live()
        if not live:
            self.do_wait(step, draws[0])
        else:
            target = live[int(focus * len(live))]
            plans = [self.plan(kind, u, target if same else live[int(u[0] * len(live))])
                     for kind, u, same in zip(picked, draws, same_job)]
            step.args = {"actions": " | ".join(plan.describe() for plan in plans),
                         **({"at": "finish"} if at_finish else {})}
            if at_finish:
                self.wait_finishing(target)
            before = {job.name: (self.observe(job), self.cap_now(job.name))
                      for job in {id(p.job): p.job for p in plans}.values()}
            threads = [threading.Thread(target=plan.run, args=(self,)) for plan in plans]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            outcomes = []
            for name, (s0, cap0) in before.items():
                job = self.jobs[name]
                outcomes.append(self.settle_burst(job, s0, cap0,
                                                  [p for p in plans if p.job is job]))
            step.outcome = "; ".join(outcomes)
        step.seconds = time.monotonic() - t0
        self.stats.steps += 1
        self.stats.kinds[step.kind] += 1
        self.stats.outcomes[step.kind] += 1
        self.log(step.line())
        self.check_all(f"after step {n}")

    def wait_finishing(self, job: JobModel, timeout: float = 30.0) -> None:
        """Until every prompt of the job has its outcome while it is still running (beat's final
        tick under way), or the timeout: the burst then goes off either way."""
        def finishing() -> bool:  # or never will: a job paused, cancelled or done already
            snap = self.snapshot(job.name)
            return snap["status"] != RUNNING or snap["completed"] + snap["failed"] >= snap["total"]

        try:
            wait_until(finishing, timeout=timeout, interval=0.05, what="the job's last outcome")
        except TimeoutError:
            pass

    def plan(self, kind: str, u: list[float], job: JobModel) -> "Plan":
        if kind == "late_duplicate":
            return Plan(kind, job, [])
        if kind == "enqueue_again":
            extra = int(u[2] * 16) if u[2] < 0.7 else 0
            cap = GOOD_CAPS[int(u[4] * len(GOOD_CAPS))] if u[5] < 0.5 else None
            rows = job.rows + self.prompt_rows(job.name, len(job.rows), extra)
            job.versions += 1  # a file of its own, whether the enqueue wins or not
            path = self.dataset(JobModel(job.name, set(), rows, versions=job.versions))
            args = ["enqueue", "--dataset", str(path), "--job", job.name,
                    "--gpus", str(1 + int(u[3] * 2))]
            return Plan(kind, job, args + (["--max-output-tokens", str(cap)] if cap else []),
                        lifecycle="enqueue", cap=cap, rows=rows)
        if kind == "set":
            cap = BAD_CAP if u[2] < 0.15 else GOOD_CAPS[int(u[3] * len(GOOD_CAPS))]
            return Plan(kind, job, ["set", "--job", job.name, "--max-output-tokens", str(cap)],
                        lifecycle="set", cap=cap)
        if kind == "regenerate":
            args = ["regenerate", "--job", job.name, "--finish-reason", "length"]
            return Plan(kind, job, args + (["--continue"] if u[2] < 0.5 else []), lifecycle=kind)
        command = kind.replace("_", "-")
        extra = ["--yes"] if kind in ("cancel", "delete") else []
        return Plan(kind, job, [command, "--job", job.name, *extra], lifecycle=command)

    def cap_now(self, job: str) -> int | None:
        raw = self.d.read(lambda r: r.hget(f"dflash:{{{job}}}:config", "params"))
        return json.loads(raw)["max_tokens"] if raw else None

    def inject_duplicate(self, job: JobModel) -> str:
        """A second delivery of one of the job's prompts, as the broker makes after a visibility
        timeout or a restore: a copy of its task message on the GPU it is in flight on (else on
        a GPU of the job, for a prompt done or failed)."""
        from failure_support import kombu_entry

        k = f"dflash:{{{job.name}}}"

        def pick(r):
            gpus = sorted(g.decode() for g in r.smembers(k + ":gpus"))
            for gpu in gpus:
                if (member := r.zrandmember(f"{k}:inflight:{gpu}")) is not None:
                    return gpu, member.decode(), "in flight"
            for key, what in ((k + ":failed", "failed"), (k + ":done", "done")):
                member = r.hrandfield(key) if what == "failed" else r.srandmember(key)
                if member is not None and gpus:
                    return gpus[0], member.decode(), what
            return None

        found = self.d.read(pick)
        if found is None:
            return "nothing to duplicate"
        gpu, prompt_id, what = found
        body = json.dumps([[job.name, prompt_id, gpu], {}, {"callbacks": None, "errbacks": None,
                                                          "chain": None, "chord": None}])
        self.d.read(lambda r: r.lpush(gpu, kombu_entry(body.encode(), "application/json", gpu,
                                                       args=[job.name, prompt_id, gpu])))
        self.stats.faults["late_duplicate"] += 1
        return f"duplicate of {prompt_id} ({what}) on {gpu}"

    def settle_burst(self, job: JobModel, s0: str, cap0: int | None, plans: list["Plan"]) -> str:
        """Check what a burst did to one job, then bring the model up to date: each command ran
        or was refused for a reason it names (the lifecycle, a compare-and-set it lost, a job
        deleted meanwhile, a cap already reached, S3 cut); the state now is one that some order
        of the commands that ran leads to; the cap now is the one the last of them reported."""
        ran = []
        for plan in plans:
            if plan.kind == "late_duplicate":
                continue
            out = plan.output
            if "Traceback" in out:
                raise ChaosFailure(f"`manage.py {' '.join(plan.args)}` crashed:\n{out[-3000:]}")
            self.stats.checks["concurrent command outcome explained"] += 1
            if plan.returncode == 0 or (plan.kind == "regenerate" and "once the storage answers" in out):
                ran.append(plan)
            elif not (("is not allowed in that state" in out) or any(t in out for t in LOST_RACE)
                      or "raise it first" in out or "when the storage answers" in out
                      or "not created" in out):
                raise ChaosFailure(f"`manage.py {' '.join(plan.args)}` exited {plan.returncode} "
                                   f"for no reason a concurrent command explains:\n{out[-2000:]}")
            # An enqueue that lost stored its new prompts all the same (and said so).
            if plan.kind == "enqueue_again" and (plan.returncode == 0 or "new prompts are stored" in out):
                job.rows = plan.rows
                job.ids |= {row["id"] for row in plan.rows}
            if plan.kind == "regenerate" and plan in ran:
                job.regenerations += 1
                job.regenerated_reasons.add("length")
        s1 = self.actual_state(job.name) or DELETED
        self.stats.checks["concurrent state explained by the commands that ran"] += 1
        if not any(self._leads_to(s0, order, s1) for order in permutations(ran)):
            raise ChaosFailure(
                f"job {job.name}: {s0} -> {s1} after {[' '.join(p.args) for p in ran]} ran "
                f"(refused: {[' '.join(p.args) for p in plans if p not in ran and p.args]}): no "
                "order of them leads there")
        if s1 == DELETED:
            job.state = DELETED
            self.check_deleted(job)
            return f"{job.name} deleted"
        if any(p.kind == "delete" for p in ran):  # deleted, then enqueued anew: a new job
            [again] = [p for p in ran if p.kind == "enqueue_again"]
            job.ids, job.rows = {row["id"] for row in again.rows}, again.rows
            job.regenerations, job.regenerated_reasons = 0, set()
            job.caps, job.bodies = [], "redis"
        job.state = RUNNING if s1 == DONE else s1
        cap1 = self.cap_now(job.name)
        self.stats.checks["cap is the last one a command reported"] += 1
        winners = [p for p in ran if p.cap is not None]
        if not any(self._caps_lead_to(cap0, order, cap1) for order in permutations(winners)):
            raise ChaosFailure(f"job {job.name}: max_tokens {cap0} -> {cap1}, but the commands "
                               f"that changed it reported {[p.reported_caps() for p in winners]}")
        if cap1 != cap0:
            job.cap = cap1
            job.caps.append(cap1)
        return f"{job.name} {s0}->{s1} ({len(ran)}/{len([p for p in plans if p.args])} ran)"

    @staticmethod
    def _leads_to(s0: str, order, s1: str) -> bool:
        """Whether the lifecycle takes s0 to s1 through these commands in this order; beat's
        done and work coming back (a late row) may turn running into done and back anywhere."""
        def widen(states: set[str]) -> set[str]:
            return states | ({RUNNING, DONE} if states & {RUNNING, DONE} else set())

        states = widen({s0})
        for plan in order:
            if plan.lifecycle == "delete":
                states = {DELETED} if any(lifecycle.allowed("delete", s) for s in states) else set()
                continue
            # An enqueue after a delete creates the job anew.
            states = widen({lifecycle.check(plan.lifecycle, "j", s) for s in states
                            if s != DELETED and lifecycle.allowed(plan.lifecycle, s)}
                           | ({RUNNING} if DELETED in states and plan.lifecycle == "enqueue" else set()))
        return s1 in states

    @staticmethod
    def _caps_lead_to(cap0, order, cap1) -> bool:
        """Whether the caps the commands reported, in this order, chain from cap0 to cap1 (a
        `set` prints the value it replaced; an enqueue's is whatever came before it)."""
        cap = cap0
        for plan in order:
            old = plan.replaced_cap()
            if old is not None and old != cap:
                return False
            cap = plan.cap
        return cap == cap1

        # ------------------------------------------------------------------ invariants
    def snapshot(self, job: str) -> dict:
        from dflash_tasks.output.progress import snapshot

        return self.d.read(lambda r: snapshot(r, JobName(job), self.d.settings))

    def check_identity(self, job: JobModel, where: str) -> dict:
        """pending + in_flight + retry_waiting + completed + failed == total == the model's ids.
        Status reads its counts in one transaction, so this holds at every instant; a mismatch
        that vanishes on a re-read within 3 s is still counted (and reported), one that lasts
        fails the test."""
        def ok(snap: dict) -> bool:
            return (accounted(snap) == snap["total"] == len(job.ids))

        self.stats.checks["accounting identity"] += 1
        snap = self.snapshot(job.name)
        if ok(snap):
            return snap
        self.stats.transient_identity_mismatches += 1
        try:
            return wait_until(lambda: (s := self.snapshot(job.name)) and ok(s) and s, timeout=3,
                              interval=0.2, what="the accounting identity")
        except TimeoutError:
            snap = self.snapshot(job.name)
            raise ChaosFailure(f"{where}: job {job.name} ({snap['status']}) does not account for "
                               f"its prompts: pending {snap['pending']} + in_flight "
                               f"{snap['in_flight']} + retry_waiting {snap.get('retry_waiting')} + "
                               f"completed {snap['completed']} + failed "
                               f"{snap['failed']} != total {snap['total']} (model: {len(job.ids)} "
                               f"ids){self.where_are_they(job)}") from None

    def where_are_they(self, job: JobModel) -> str:
        """Where the ledger holds the job's ids, per key, to explain a mismatch."""
        k = f"dflash:{{{job.name}}}"
        r = self.d.c.r
        parts = [f"gpus {self.config(job.name).get('gpus')}"]
        gpus = sorted(m.decode() for m in r.smembers(k + ":gpus"))
        for g in gpus:
            n = r.zcard(f"{k}:inflight:{g}")
            if n:
                parts.append(f"inflight:{g}={n}")
        queues = " ".join(f"{g}={r.llen(g)}" for g in gpus)
        parts.append(f"pending={r.llen(k + ':pending')} done={r.scard(k + ':done')} "
                     f"failed={r.hlen(k + ':failed')} queues {queues} unacked={r.hlen('unacked')}")
        held = {m.decode() for g in gpus for m in r.zrange(f"{k}:inflight:{g}", 0, -1)}
        held |= {m.decode() for m in r.lrange(k + ":pending", 0, -1)}
        held |= {m.decode() for m in r.smembers(k + ":done")}
        held |= {m.decode() for m in r.hkeys(k + ":failed")}
        nowhere = sorted(job.ids - held)
        if nowhere:
            parts.append(f"ids in none of them: {nowhere[:10]}")
        return "\n  ledger: " + ", ".join(parts)

    def shipped(self, job: str) -> list[dict]:
        from dflash_tasks.output.batches import read_batch, read_manifest

        storage = self.d.storage
        if not storage.exists(f"{job}/manifest.json"):
            return []
        manifest = read_manifest(storage, job)
        return [row for record in manifest["batches"] for row in read_batch(storage, record)]

    def check_shipped(self, job: JobModel, rows: list[dict]) -> dict[str, dict]:
        """Every id at most once, beyond rows that regenerate replaced; returns the newest row
        per id."""
        self.stats.checks["shipped at most once"] += 1
        by_id: dict[str, list[dict]] = defaultdict(list)
        for row in rows:
            by_id[row["id"]].append(row)
        unknown = sorted(set(by_id) - job.ids)
        if unknown:
            raise ChaosFailure(f"job {job.name}: shipped ids that are not its prompts: {unknown[:10]}")
        for pid, copies in by_id.items():
            if len(copies) == 1:
                continue
            copies.sort(key=lambda r: r["metadata"]["completed_at"])
            older = copies[:-1]
            if (len(copies) > 1 + job.regenerations
                    or any(r["metadata"]["finish_reason"] not in job.regenerated_reasons for r in older)):
                raise ChaosFailure(
                    f"job {job.name}: id {pid} shipped {len(copies)} times (regenerated "
                    f"{job.regenerations} times, reasons {sorted(job.regenerated_reasons)}); finish "
                    f"reasons {[r['metadata']['finish_reason'] for r in copies]}")
        return {pid: copies[-1] for pid, copies in by_id.items()}

    def check_ledger_counters(self, job: JobModel) -> None:
        k = f"dflash:{{{job.name}}}"

        def read(r):
            pipe = r.pipeline(transaction=True)
            pipe.hmget(k + ":counters", "completed", "failed")
            pipe.scard(k + ":done")
            pipe.hlen(k + ":failed")
            return pipe.execute()

        self.stats.checks["counters equal the ledger"] += 1
        (completed, failed), done, registry = self.d.read(read)
        if int(completed or 0) != done or int(failed or 0) != registry:
            raise ChaosFailure(f"job {job.name}: counters completed {completed} / failed {failed}, "
                               f"ledger done set {done} / failed registry {registry}")

    def check_all(self, where: str) -> None:
        for job in self.live():
            snap = self.check_identity(job, where)
            self.check_ledger_counters(job)
            self.check_shipped(job, self.shipped(job.name))
            state = snap["status"]
            if not (state == job.state or (job.state == RUNNING and state == DONE)):
                raise ChaosFailure(f"{where}: job {job.name} is {state}, the model holds {job.state}")
            if state == DONE:
                self.check_done(job, where)

    def check_done(self, job: JobModel, where: str) -> None:
        """A job reported done: every prompt completed or failed, nothing left anywhere, every
        prompt shipped or in the failed registry (manifest.json may trail Redis by a moment)."""
        self.stats.checks["done means every prompt has its outcome"] += 1

        def books() -> str:
            snap = self.snapshot(job.name)
            if snap["status"] != DONE:
                return ""       # reopened in between by nothing of ours: checked elsewhere
            problems = []
            if snap["completed"] + snap["failed"] != snap["total"] or snap["total"] != len(job.ids):
                problems.append(f"completed {snap['completed']} + failed {snap['failed']} != "
                                f"total {snap['total']} (model {len(job.ids)})")
            if snap["pending"] or snap["in_flight"] or snap.get("retry_waiting") or snap["unsealed_rows"]:
                problems.append(f"pending {snap['pending']}, in_flight {snap['in_flight']}, "
                                f"unsealed {snap['unsealed_rows']}")
            failed = {m.decode() for m in self.d.c.r.hkeys(f"dflash:{{{job.name}}}:failed")}
            shipped = {row["id"] for row in self.shipped(job.name)}
            missing = job.ids - shipped - failed
            if missing:
                problems.append(f"{len(missing)} ids neither shipped nor failed: {sorted(missing)[:10]}")
            return "; ".join(problems)

        problems = books()
        if problems:
            try:
                wait_until(lambda: not books(), timeout=10, interval=0.5, what="done books")
            except TimeoutError:
                raise ChaosFailure(f"{where}: job {job.name} is done but {books()}"
                                   f"{self.where_are_they(job)}") from None

    def check_deleted(self, job: JobModel) -> None:
        self.stats.checks["deleted job has no keys"] += 1
        keys = self.d.read(lambda r: list(r.scan_iter(match=f"dflash:\\{{{job.name}\\}}:*")))
        member = self.d.read(lambda r: r.sismember("dflash:jobs", job.name))
        if keys or member:
            raise ChaosFailure(f"deleted job {job.name} still has keys {sorted(keys)[:10]} "
                               f"(in dflash:jobs: {bool(member)})")
        chunks = self.d.storage.list(f"{job.name}/prompts/")
        if chunks:
            raise ChaosFailure(f"deleted job {job.name} left its prompts' texts on S3: {chunks[:5]}")

    def exact_books(self, job: JobModel, *, allow_failed: bool) -> int:
        """check_books for a done job, allowing for regenerated rows: the newest row per id is
        the prompt's row; counters (through `manage.py status --json`) equal those rows."""
        self.stats.checks["exact books at the end"] += 1
        rows = self.shipped(job.name)
        newest = self.check_shipped(job, rows)
        failed = {m.decode() for m in self.d.c.r.hkeys(f"dflash:{{{job.name}}}:failed")}
        if failed and not allow_failed:
            raise ChaosFailure(f"job {job.name}: {len(failed)} prompts failed though its cap always "
                               f"fit the context: {sorted(failed)[:5]}")
        ok = job.ids - failed
        missing = ok - set(newest)
        if missing:
            raise ChaosFailure(f"job {job.name} done without rows for {sorted(missing)[:10]}")
        snap = self.d.c.status(job.name)   # the CLI's own view
        counters = {k.decode(): int(v) for k, v in
                    self.d.c.r.hgetall(f"dflash:{{{job.name}}}:counters").items()}
        per_gpu = sum(v for k, v in counters.items() if k.startswith("gpu:") and k.endswith(":completed"))
        want = {
            "completed": len(ok), "failed": len(failed), "total": len(job.ids),
            "total_output_tokens": sum(newest[i]["metadata"]["completion_tokens"] for i in ok),
            "total_input_tokens": sum(newest[i]["metadata"]["prompt_tokens"] for i in ok),
        }
        got = {key: snap[key] for key in want}
        if got != want or per_gpu != len(ok):
            raise ChaosFailure(f"job {job.name}: status {got}, the shipped rows say {want}; "
                               f"per-GPU completed counters add up to {per_gpu}")
        return len(ok)

    # ------------------------------------------------------------------ the end
    def restore(self) -> None:
        """Stop the faults: every worker and beat running, every server answering, S3 up."""
        self.d.s3_up()
        for gpu in range(GPUS):
            if not self.d.c.workers[gpu].alive():
                self.d.start_worker(gpu)
        if not self.d.c.beat.alive():
            self.stats.notes.append(f"seed {self.cfg.seed}: beat had exited:\n{self.d.c.beat.log()[-1500:]}")
            self.d.c.start_beat()
        for gpu in range(GPUS):
            self.wait_server(gpu)

    def wait_server(self, gpu: int) -> None:
        wait_until(lambda: httpx.get(f"{self.d.c.url(gpu)}/health", timeout=5).status_code == 200,
                   timeout=60, interval=0.2, what=f"server gpu{gpu} up")

    def wait_all_done(self, jobs: list[JobModel], phase: str) -> None:
        t0 = time.monotonic()
        for job in jobs:
            left = max(5.0, self.cfg.converge_s - (time.monotonic() - t0))
            try:
                wait_until(lambda: self.snapshot(job.name)["status"] == DONE, timeout=left,
                           interval=0.5, what=f"job {job.name} to be done")
            except TimeoutError:
                snap = self.snapshot(job.name)
                raise ChaosFailure(
                    f"{phase}: job {job.name} not done {self.cfg.converge_s:.0f}s after the faults "
                    f"stopped: {snap['status']}, total {snap['total']}, completed "
                    f"{snap['completed']}, failed {snap['failed']}, pending {snap['pending']}, "
                    f"in_flight {snap['in_flight']}, unsealed {snap['unsealed_rows']}"
                    f"{self.where_are_they(job)}") from None
        self.stats.converge_seconds.append(round(time.monotonic() - t0, 1))
        self.stats.checks["converged to done after faults"] += len(jobs)

    def finish(self) -> None:
        self.steps.append(Step(len(self.steps) + 1, "faults stop", {}, "all processes up"))
        self.restore()
        self.check_all("after the faults stopped")
        # 1. every job neither paused nor cancelled reaches done; paused/cancelled stay so
        self.wait_all_done(self.live(RUNNING), "faults stopped")
        for job in self.live():
            self.check_identity(job, "the end")
            if job.state == RUNNING:
                self.check_done(job, "the end")
                self.exact_books(job, allow_failed=job.bad_cap_ever)
            else:
                self.observe(job)
        for job in [j for j in self.jobs.values() if j.state == DELETED]:
            self.check_deleted(job)
        # 2. everything resumed, failures retried under a cap that fits: all of it finishes
        step = Step(len(self.steps) + 1, "finish all", {}, "")
        self.steps.append(step)
        for job in self.live(PAUSED, CANCELLED):
            self.command(step, job, "resume", ["resume", "--job", job.name])
        for job in self.live():
            if job.bad_cap_ever:
                self.command(step, job, "set", ["set", "--job", job.name, "--max-output-tokens", "1024"])
                job.cap = 1024
                job.caps.append(1024)
                self.wait_all_done([job], "before retry-failed")
                self.command(step, job, "retry-failed", ["retry-failed", "--job", job.name,
                                                         "--include-permanent"])
        self.wait_all_done(self.live(), "finish all")
        generated = 0
        for job in self.live():
            self.check_done(job, "finish all")
            generated += self.exact_books(job, allow_failed=False)
        for job in [j for j in self.jobs.values() if j.state == DELETED]:
            self.check_deleted(job)
        step.outcome = f"ok: {generated} prompts in {len(self.live())} jobs"
        self.stats.prompts_generated += generated
        for name, proc in [*((f"worker gpu{g}", p) for g, p in self.d.c.workers.items()),
                           ("beat", self.d.c.beat)]:
            if "Unrecoverable error" in proc.log():
                raise ChaosFailure(f"{name} logged an unrecoverable error:\n{proc.log()[-2000:]}")


def report_markdown(stats: Stats, cfg: dict, seconds: float) -> str:
    lines = [
        "# Chaos report", "",
        f"- command: `{cfg['command']}`",
        f"- duration: {seconds / 60:.1f} min; sequences: {stats.sequences}; steps: {stats.steps}; "
        f"jobs: {stats.jobs}",
        f"- prompts generated (newest rows checked at the end): {stats.prompts_generated:,}",
        f"- failures: {len(stats.failures)}",
        f"- actions skipped: {cfg.get('skip') or 'none'}",
        "", "| action | steps |", "|---|---|",
        *(f"| {k} | {v} |" for k, v in sorted(stats.kinds.items())),
        "", "| fault injected | times |", "|---|---|",
        *(f"| {k} | {v} |" for k, v in sorted(stats.faults.items())),
        "", "| outcome | steps |", "|---|---|",
        *(f"| {k} | {v} |" for k, v in sorted(stats.outcomes.items())),
        "", "| invariant check | times |", "|---|---|",
        *(f"| {k} | {v} |" for k, v in sorted(stats.checks.items())),
        "", f"Accounting-identity mismatches that vanished on a re-read within 3 s: "
        f"{stats.transient_identity_mismatches}",
        f"Seconds to converge after the faults stopped: {stats.converge_seconds}",
    ]
    if stats.notes:
        lines += ["", "## Notes", "", *(f"- {n}" for n in stats.notes)]
    for f in stats.failures:
        lines += ["", f"## Failure, seed {f['seed']}", "", f"Replay: `{f['replay']}`", "",
                  "```", *f["ran"], "```", "", "```", f["error"], "```", f"Logs: {f['logs']}"]
    return "\n".join(lines) + "\n"
