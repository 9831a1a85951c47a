"""A job: its name, generation parameters and status, stored in Redis so every worker sees a
change at the next prompt it takes."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Callable, Iterable

import redis

from dflash_tasks.core.keys import JOBS, GpuName, JobName, check_node_name
from dflash_tasks.core.scripts import Script

NEXT_BODY_CHUNK = Script(__file__, "next_body_chunk")


@dataclass(frozen=True, slots=True)
class GenerationParams:
    max_tokens: int = 8192
    temperature: float = 0.6       # Qwen3's recommended thinking-mode sampling
    top_p: float = 0.95
    top_k: int | None = 20
    enable_thinking: bool = True
    # Sent on every request, like the three above: SGLang's chat endpoint fills an unset one from
    # the model's generation_config.json (`--sampling-defaults model`), /generate does not, so a
    # continued generation would sample otherwise. Qwen3's thinking-mode values.
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1 and self.top_k != -1:
            raise ValueError(f"top_k must be >= 1 (or -1 for all), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")

    def sampling(self) -> dict:
        """Every parameter SGLang would otherwise take from the model's generation_config.json,
        as both endpoints take them (top_k -1: off)."""
        return {"temperature": self.temperature, "top_p": self.top_p,
                "top_k": -1 if self.top_k is None else self.top_k, "min_p": self.min_p,
                "repetition_penalty": self.repetition_penalty}

    @property
    def continuable(self) -> bool:
        """Whether going on from a cut samples as one request would. SGLang's penalties count
        only a request's own output ids, so a penalised generation is never cut in two."""
        return self.repetition_penalty == 1.0

    @classmethod
    def from_dict(cls, data: dict) -> "GenerationParams":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def stored(self) -> str:
        """As the job's config hash stores them."""
        return json.dumps(asdict(self))

    def replace(self, **changes) -> "GenerationParams":
        return GenerationParams(**{**asdict(self), **{k: v for k, v in changes.items() if v is not None}})


def request_seed(job: str, prompt_id: str, turn: int = 0) -> int:
    """The sampling seed every request of a prompt sends (chat's `seed`, /generate's
    `sampling_seed`): a hash of the job and the prompt's id, so each sample of a prompt has its
    own, and every part of a continued generation the same. SGLang reads it only under
    --enable-deterministic-inference, where a request without one gets 42: every sample of a
    prompt would be the same row. Otherwise each request draws from the sampler's own random
    state and the seed is ignored (docs/SGLANG_0.5.23.md). Each reply of a conversation after
    its first (`turn`) has its own."""
    key = f"{job}\0{prompt_id}" + (f"\0{turn}" if turn else "")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # in SGLang's range, [-2**63, 2**63 - 1]


@dataclass(frozen=True, slots=True)
class GpuSelection:
    """The GPUs a job may use, among those registered now or later (a node that joins takes
    work at once when it is selected): `gpus` is "all", a count N (the local indices 0 to N-1
    on each node) or GPU names ("gpu0@a,gpu3@b"); `nodes`, when not empty, keeps only those
    nodes' GPUs. take.lua checks the same rule in Redis."""
    gpus: str = "all"
    nodes: tuple[str, ...] = ()

    @classmethod
    def parse(cls, gpus: str | None = None, nodes: str | None = None) -> "GpuSelection":
        """From `enqueue --gpus/--nodes`; raises ValueError naming the bad part."""
        spec = (gpus or "all").strip()
        if spec != "all" and not spec.isdigit():
            names = [g.strip() for g in spec.split(",") if g.strip()]
            bad = sorted(set(names).difference(GpuName.among(names)))
            if not names or bad:
                raise ValueError(f"--gpus takes `all`, a count N (gpu0..gpuN-1 of each node) or GPU "
                                 f"names like gpu0@node-a,gpu1@node-a; not {', '.join(bad) or spec!r}")
            spec = ",".join(dict.fromkeys(names))
        elif spec.isdigit() and int(spec) < 1:
            raise ValueError("--gpus N needs N >= 1")
        node_names = tuple(dict.fromkeys(n.strip() for n in (nodes or "").split(",") if n.strip()))
        for node in node_names:
            check_node_name(node)
        return cls(gpus=spec, nodes=node_names)

    def allows(self, gpu: GpuName) -> bool:
        if self.nodes and gpu.node not in self.nodes:
            return False
        if self.gpus == "all":
            return True
        if self.gpus.isdigit():
            return gpu.local_index < int(self.gpus)
        return gpu in self.gpus.split(",")

    def describe(self) -> str:
        what = {"all": "every GPU"}.get(self.gpus) or (
            f"gpu0..gpu{int(self.gpus) - 1}" if self.gpus.isdigit() else self.gpus)
        return what + (f" of node(s) {','.join(self.nodes)}" if self.nodes
                       else " of every node" if self.gpus.isdigit() or self.gpus == "all" else "")


@dataclass(frozen=True, slots=True)
class Job:
    name: JobName
    params: GenerationParams
    status: str
    selection: GpuSelection
    dataset: str
    created_at: float
    # Where its batches go: an absolute directory or an s3:// URI, fixed when the job is made so
    # every command finds them from any directory ("" for a job made before jobs kept it: the
    # deployment's location then).
    output: str = ""
    # Rows per prompt (enqueue --samples): each sample a prompt of its own, its id the prompt's
    # and "#k" (ingest/prompts.py's sample_id); 1, the prompt's own id.
    samples: int = 1
    # Which assistant turns of a conversation are generated (enqueue --turns): "last", the last
    # reply after the dataset's own earlier ones, or "all", every reply in the context of the
    # target's own earlier ones (core/conversation.py). Fixed by the job's first enqueue.
    turns: str = "last"
    # The replies a prompt asks for on average (core/conversation.py's replies), as its last
    # enqueue read them: a job of conversations' ETA (output/progress.py). 1 for one reply each.
    replies_per_prompt: float = 1.0
    # Why its dataset is not all stored (mark_incomplete), or "" when it is
    incomplete: str = ""
    # The config hash exactly as read: what a command's compare-and-set expects to find again.
    stored: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def as_read(self, *names: str) -> dict[str, list[str]]:
        """Ledger.update_job's expectation: these fields still as this command read them."""
        return {name: [self.stored.get(name, "")] for name in names}


def mark_incomplete(r: redis.Redis, name: JobName, reason: str | None) -> None:
    """Say that the job's dataset is not all stored (an enqueue interrupted or failed midway),
    and why; None: it is, again. Beat never marks an incomplete job done (finish.lua)."""
    if reason is None:
        r.hdel(name.config, "incomplete")
    elif r.exists(name.config):
        r.hset(name.config, "incomplete", reason)


def load(r: redis.Redis, name: JobName) -> Job | None:
    raw = r.hgetall(name.config)
    if not raw:
        return None
    d = {k.decode(): v.decode() for k, v in raw.items()}
    return Job(name=name, params=GenerationParams.from_dict(json.loads(d["params"])),
               status=d.get("status", "running"),
               selection=GpuSelection(gpus=d.get("gpus", "all"),
                                      nodes=tuple(n for n in d.get("nodes", "").split(",") if n)),
               dataset=d.get("dataset", ""), created_at=float(d.get("created_at", 0)),
               output=d.get("output", ""), samples=int(d.get("samples") or 1),
               turns=d.get("turns") or "last",
               replies_per_prompt=float(d.get("replies_per_prompt") or 1.0),
               incomplete=d.get("incomplete", ""), stored=d)


def config_fields(params: GenerationParams, selection: GpuSelection) -> dict[str, str]:
    """A job's parameters and GPU selection as its config hash stores them."""
    return {"params": params.stored(), "gpus": selection.gpus,
            "nodes": ",".join(selection.nodes)}


def save(r: redis.Redis, name: JobName, params: GenerationParams, *, selection: GpuSelection,
         dataset: str, status: str = "running", output: str = "", samples: int = 1,
         turns: str = "last") -> Job:
    """Create the job (unconditionally: a new job's first write, or a test's). Every later change
    is a compare-and-set against what its command read (Ledger.update_job, Ledger.transition)."""
    pipe = r.pipeline()
    pipe.hsetnx(name.config, "created_at", time.time())
    pipe.hset(name.config, mapping={**config_fields(params, selection), "dataset": dataset,
                                 "status": status, "samples": samples, "turns": turns,
                                 **({"output": output} if output else {})})
    pipe.sadd(JOBS, name)
    pipe.execute()
    job = load(r, name)
    assert job is not None
    return job


def names(r: redis.Redis, skipped: Callable[[str, ValueError], object] | None = None,
          ) -> list[JobName]:
    """Every job's name. A member of the set that is no job name (written by hand: enqueue
    checks every name) is left out, and given to `skipped` with the reason."""
    found = []
    for member in r.smembers(JOBS):
        raw = member.decode(errors="replace")
        try:
            found.append(JobName(raw))
        except ValueError as exc:
            if skipped is not None:
                skipped(raw, exc)
    return sorted(found)


def body_location(r: redis.Redis, name: JobName, wanted: str | None = None) -> str | None:
    """Where the job's prompt bodies are kept on storage (ledger/bodies.py), or None while they
    are all in Redis. With `wanted`, the first caller's location becomes the job's; later ones
    get that one back, so every chunk of a job is in one place."""
    if wanted is None:
        found = r.hget(name.config, "bodies")
    else:  # read in the same step: the job deleted just after would answer None
        found = _write_if_exists(r, name, lambda pipe: pipe.hsetnx(name.config, "bodies", wanted)
                                 .hget(name.config, "bodies"))
    return found.decode() if found is not None else None


def next_body_chunk(r: redis.Redis, name: JobName) -> int:
    """A chunk number no job of this name has used, not even one deleted since (chunk objects
    are never rewritten): a deletion then removes its own chunks, never a later job's."""
    number = int(NEXT_BODY_CHUNK(r, config=name.config, chunk_numbers=name.chunk_numbers))
    if not number:
        raise JobDeleted(f"job {name} was deleted while this ran")
    return number


def last_body_chunk(r: redis.Redis, name: JobName) -> int:
    """The highest chunk number given so far to a job of this name (0: none yet)."""
    return _last_body_chunk(r, name)


def _last_body_chunk(pipe, name: JobName) -> int:
    """The highest chunk number given so far to a job of this name: its counter that outlives
    the job, or the job's own when higher (a job made before that counter existed numbered its
    chunks in its config alone)."""
    return max(int(pipe.get(name.chunk_numbers) or 0),
               int(pipe.hget(name.config, "body_chunks") or 0))


class JobDeleted(LookupError):
    """The job was deleted (or never was) when a write into its config came."""


def _write_if_exists(r: redis.Redis, name: JobName, write):
    """write(pipeline) in a transaction, only while the job exists (its config has a status):
    a write into the config of a job deleted meanwhile would leave a config of nothing behind,
    which every ledger script would take for a job. Returns its last command's answer."""
    with r.pipeline() as pipe:
        while True:
            try:
                pipe.watch(name.config)
                if not pipe.hexists(name.config, "status"):
                    raise JobDeleted(f"job {name} was deleted while this ran")
                pipe.multi()
                write(pipe)
                return pipe.execute()[-1]
            except redis.WatchError:
                continue


@dataclass(frozen=True, slots=True)
class Deleted:
    """What `delete` removed from Redis, and what of the job's it leaves on storage."""
    keys: int
    bodies: str | None   # where its prompt bodies are kept (ledger/bodies.py), if anywhere
    chunks_through: int  # its chunks there are numbered this or lower, a later job's higher


def delete(r: redis.Redis, name: JobName, allowed: Iterable[str] | None = None) -> Deleted:
    """Remove every Redis key of the job and its name; batches already shipped stay where they
    are, and so do its prompt bodies' chunks, for the caller to remove once the job is gone
    (bodies.remove_chunks, with what this returns). With `allowed`, only while the job's
    status is one of them, checked in the same transaction that removes its config (a `resume`
    in between is not deleted): after that no ledger script writes for it any more, and the rest
    of its keys go. Raises JobDeleted when there was no such job, and ValueError when its status
    is not allowed (the message names it)."""
    with r.pipeline() as pipe:
        while True:
            try:
                pipe.watch(name.config, name.chunk_numbers)
                status, bodies = pipe.hmget(name.config, "status", "bodies")
                if allowed is not None:
                    if status is None:
                        raise JobDeleted(f"job {name} was deleted meanwhile")
                    if status.decode() not in allowed:
                        raise ValueError(f"job {name} changed to {status.decode()} while this ran")
                # Read with the config's removal: a chunk numbered above it is a later job's.
                through = _last_body_chunk(pipe, name)
                pipe.multi()
                pipe.delete(name.config)
                pipe.srem(JOBS, name)
                if bodies is not None:  # one that numbered its chunks in its config alone
                    pipe.set(name.chunk_numbers, through)
                removed = pipe.execute()[0]
                break
            except redis.WatchError:
                continue
    rest = list(r.scan_iter(match=name.every_key, count=1000))
    return Deleted(keys=int(removed) + (int(r.delete(*rest)) if rest else 0),
                   bodies=bodies.decode() if bodies is not None else None, chunks_through=through)
