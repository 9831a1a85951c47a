"""Every Redis key the project owns, and every Celery task and queue name, in one place.
docs/ARCHITECTURE.md explains each key.

Per-job keys carry the job name in braces, a Redis Cluster hash tag, so the multi-key Lua
scripts of the ledger touch one slot.
"""
from __future__ import annotations

import re
from typing import Iterable

PREFIX = "dflash"
JOBS = f"{PREFIX}:jobs"          # set: every job name ever enqueued
# The GPU registry, each hash keyed by GPU name ("gpu3@node-a", GpuName below):
WORKERS = f"{PREFIX}:workers"    # hash: GPU -> JSON {concurrency, hostname, url, started_at}
BREAKERS = f"{PREFIX}:breakers"  # hash: GPU -> JSON {state, consecutive_failures, last_error, ...}
SERVERS = f"{PREFIX}:servers"    # hash: GPU -> JSON of its SGLang server's /metrics sample
WORKERS_SEEN = f"{PREFIX}:workers:seen"  # hash: GPU -> Redis time of the worker's last heartbeat
BEAT_SEEN = f"{PREFIX}:beat:seen"  # string: Redis time of beat's last tick (status: is beat running?)
# string: JSON {used_memory, maxmemory, since}, present while Redis's memory is above the hold
# ratio of its maxmemory: no job dispatches (take.lua) until beat's maintain finds it below.
MEMORY_HOLD = f"{PREFIX}:memory:hold"
# list per GPU, MIGRATIONS + GPU: "<job>\n<id>" of the generations its worker is to abort and hand
# over to a faster GPU (take.lua pushes, the worker's migration thread pops).
MIGRATIONS = f"{PREFIX}:migrations:"


# Celery task and queue names: the contract between the processes that send and run messages
# (renaming one strands the messages already queued under the old name).
GENERATE_TASK = "dflash_tasks.generate"  # one prompt, on its GPU's queue
TICK_TASK = "dflash_tasks.tick"          # beat: seal and ship batches, progress.json
MAINTAIN_TASK = "dflash_tasks.maintain"  # beat: windows full, lost and stranded work back
TRAIN_TASK = "dflash_tasks.train"        # one training run, on the train queue
LAUNCH_TRAINING_TASK = "dflash_tasks.launch_training"  # beat: queue the runs whose data is ready
CONTROL_QUEUE = "control"                # beat's tasks (and Celery's default queue)
TRAIN_QUEUE = "train"

def _name(longest: int) -> str:
    """A name's pattern: letters, digits, '_', '.', '-', starting with a letter or digit."""
    return rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{longest - 1}}}"


JOB_NAME_MAX, NODE_NAME_MAX = 100, 63
_JOB_NAME = re.compile(rf"^{_name(JOB_NAME_MAX)}$")
_NODE_NAME = re.compile(rf"^{_name(NODE_NAME_MAX)}$")
_GPU_NAME = re.compile(rf"^gpu(\d{{1,4}})@({_name(NODE_NAME_MAX)})$")


def _checked(name: str, pattern: re.Pattern, what: str, longest: int) -> str:
    if not pattern.match(name):
        raise ValueError(f"invalid {what} name {name!r}: use letters, digits, '_', '.', '-' "
                         f"(at most {longest}, starting with a letter or digit)")
    return name


def check_job_name(name: str) -> str:
    return _checked(name, _JOB_NAME, "job", JOB_NAME_MAX)


def check_node_name(name: str) -> str:
    return _checked(name, _NODE_NAME, "node", NODE_NAME_MAX)


class GpuName(str):
    """A GPU's name, unique in the deployment: its local index on its node, as Celery names a
    worker ("gpu3@node-a"). Its Celery queue and its worker bear the same name, so the value is
    its queue's name too. Made, and so checked, once where a name comes in (a command's option,
    a task's argument, a queue or registry name); below that it is passed as is, carrying its
    node and index."""

    local_index: int  # on its node (not str.index)
    node: str

    def __new__(cls, name: str) -> "GpuName":
        m = _GPU_NAME.match(name)
        if not m:
            raise ValueError(f"invalid GPU name {name!r}: gpuI@node, like gpu0@node-a")
        gpu = super().__new__(cls, name)
        gpu.local_index, gpu.node = int(m.group(1)), m.group(2)
        return gpu

    @classmethod
    def on(cls, node: str, index: int) -> "GpuName":
        return cls(f"gpu{index}@{check_node_name(node)}")

    @classmethod
    def among(cls, names: Iterable[str | bytes]) -> list["GpuName"]:
        """The GPU names among these (queue names, registry fields), by node then index (gpu2
        before gpu10); other names are left out."""
        found = set()
        for raw in names:
            name = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            if _GPU_NAME.match(name):
                found.add(cls(name))
        return sorted(found, key=GpuName.order)

    def order(self) -> tuple[str, int]:
        """Sort key: by node, then local index."""
        return self.node, self.local_index


class JobName(str):
    """A job's name, made, and so checked, once where a name comes in (a command's argument, a
    task's, a name read back from Redis); below that it is passed as is, carrying the keys of
    the job's data. The name is in braces in each, a Redis Cluster hash tag, so the multi-key
    Lua scripts touch one slot."""

    def __new__(cls, name: str) -> "JobName":
        return super().__new__(cls, check_job_name(name))

    def _k(self, name: str) -> str:
        return f"{PREFIX}:{{{self}}}:{name}"

    @property
    def config(self) -> str:      # hash: params (JSON), status, gpus, nodes, dataset, created_at
        return self._k("config")

    @property
    def prompts(self) -> str:     # hash: prompt id -> JSON messages; removed once done
        return self._k("prompts")

    @property
    def pending(self) -> str:     # list: ids not yet dispatched, in dataset order
        return self._k("pending")

    def inflight(self, gpu: str) -> str:  # zset: ids dispatched to the GPU -> dispatch time
        return self._k(f"inflight:{gpu}")

    @property
    def migrating(self) -> str:   # hash: id -> "<from gpu> <to gpu> <time>": a generation ordered
        # moved off a slower GPU (take.lua), until the worker there hands it over (hand_over.lua)
        return self._k("migrating")

    @property
    def going_on(self) -> str:    # hash: id -> output tokens its generation holds before its
        # current request (next_round.lua and hand_over.lua set, complete.lua drops): what a
        # prompt in flight has generated, for the ETA (progress.py), ~70 B per generation
        # between rounds or moved
        return self._k("going_on")

    def retrying(self, gpu: str) -> str:  # zset: ids whose retry waits for its ETA in the GPU's
        # worker -> when it is due (retry.lua adds, the task's next run removes)
        return self._k(f"retrying:{gpu}")

    @property
    def gpus(self) -> str:        # set: every GPU the job ever dispatched to (take.lua adds them)
        return self._k("gpus")

    @property
    def speed(self) -> str:       # hash: GPU -> its requests' output tokens/s (a moving average)
        return self._k("speed")

    @property
    def every_key(self) -> str:   # SCAN pattern of every key of the job (they share its hash tag)
        return self._k("*").replace("{", "\\{").replace("}", "\\}")

    @property
    def chunk_numbers(self) -> str:  # string: the last number given to a chunk of prompt bodies
        # (ledger/bodies.py) of any job of this name. Not one of the job's keys (every_key): it
        # outlives the job, so a later job of its name numbers its chunks after the deleted
        # one's, and a deletion removes only its own (jobs.delete). Its hash tag is the job's.
        return f"{PREFIX}:body_chunks:{{{self}}}"

    @property
    def done(self) -> str:        # set: ids whose row is in the output
        return self._k("done")

    def ended(self, reason: str) -> str:  # hash: id -> "<stream entry> <prompt tokens> <output
        # tokens> <gpu>\n<prompt>" of each done id whose newest row ended `reason` (not "stop")
        return self._k(f"ended:{reason}")

    @property
    def superseding(self) -> str:  # hash: id -> the place of its row a regenerate took back
        # (its stream entry, or its batch's first entry), until its new row is recorded
        return self._k("superseding")

    @property
    def superseded(self) -> str:  # set: "<place> <id>" of each row replaced by a newer one:
        # beat writes them to <job>/superseded.json
        return self._k("superseded")

    @property
    def superseded_written(self) -> str:  # string: how many of them superseded.json lists
        return self._k("superseded:written")

    @property
    def failed(self) -> str:      # hash: id -> JSON {reason, error, attempts, gpu, at}
        return self._k("failed")

    @property
    def failures(self) -> str:    # hash: id -> times it entered the failed registry (kept for history)
        return self._k("failures")

    @property
    def counters(self) -> str:    # hash: total, completed, failed, tokens, per reason, per GPU
        return self._k("counters")

    @property
    def rate(self) -> str:        # hash: "c:<bucket>" completions, "t:<bucket>" output tokens
        return self._k("rate")

    @property
    def output(self) -> str:      # stream: finished rows waiting to be sealed into a batch
        return self._k("output")

    @property
    def sealing(self) -> str:     # string: JSON of the batch being written (crash recovery)
        return self._k("sealing")

    @property
    def manifest(self) -> str:    # hash: batch name -> JSON {rows, bytes, sha256, ...}
        return self._k("manifest")

    @property
    def manifest_parts(self) -> str:  # string: how many parts of manifest.json are written
        return self._k("manifest:parts")

    @property
    def flush_lock(self) -> str:  # string with TTL: one batch writer at a time
        return self._k("lock:flush")

    @property
    def tick_lock(self) -> str:   # string with TTL: one beat tick (seal + progress.json) at a time
        return self._k("lock:tick")

    def quality(self, part: str) -> str:  # training/data/monitor.py: cursor, window, sampled, ...
        return self._k(f"quality:{part}")

    @property
    def hold(self) -> str:        # hash: reason, error, since: present while the job dispatches nothing
        return self._k("hold")

    @property
    def storage_error(self) -> str:  # hash: error, since, last_at, failures (while storage fails)
        return self._k("storage_error")


# Training runs (dflash_tasks/training/queue): one hash per run, the set of runs, a per-job counter
# that names them. A run is not a job's data, so its keys carry no job hash tag.
TRAIN_RUNS = f"{PREFIX}:train:runs"  # zset: run name -> created time


def train_run(run: str) -> str:     # hash: the run (runs.py says every field)
    return f"{PREFIX}:train:run:{run}"


def train_seq(job: str) -> str:     # counter: the job's last run number (runs are job-train-N)
    return f"{PREFIX}:train:seq:{job}"
