"""Process-wide configuration, read once from the environment (DFLASH_*).

Per-job generation parameters (max tokens, sampling, thinking) are not here: they belong to the
job and live in Redis, so `manage.py set` reaches every worker without a restart.
"""
from __future__ import annotations

import os
import random
import re
import socket
import time
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from dflash_tasks.core.keys import GpuName, check_node_name


class Settings(BaseSettings):
    # hide_input_in_errors: a rejected value (a URL) may hold a password.
    model_config = SettingsConfigDict(env_prefix="DFLASH_", extra="ignore", hide_input_in_errors=True)

    # One Redis (redis://[:password@]host:port/db, rediss://), or Redis Sentinel in kombu's
    # syntax, sentinel://host:26379;sentinel://host2:26379 (a db other than 0 on every
    # sentinel: sentinel://host:26379/2;sentinel://host2:26379/2): every process asks the
    # sentinels for the master of redis_master_name whenever it (re)connects, so a failover is
    # followed without a restart.
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_master_name: str = "mymaster"
    # The password of the Redis servers (their requirepass; the replicas' masterauth), outside
    # the URL so nothing that prints a URL can show it; one written in a redis:// URL wins. The
    # sentinels have their own (sentinel.conf's requirepass), if any. A sentinel:// URL carries
    # none: kombu and Celery would take it for the master's, an operator for the sentinels'.
    redis_password: SecretStr | None = None
    redis_sentinel_password: SecretStr | None = None
    # Replication is asynchronous: a failover can lose the master's last writes. With
    # redis_wait_replicas > 0 (1 recommended with Sentinel), a row is recorded, and a batch
    # shipped, only once that many replicas have it (Redis WAIT), waiting at most
    # redis_wait_timeout_ms (then it goes on, with a warning: a replica down must not stop the run).
    redis_wait_replicas: int = Field(0, ge=0)
    redis_wait_timeout_ms: int = Field(1000, ge=1)
    output_dir: Path = Path("output")
    s3_uri: str | None = None
    # Where beat keeps the sealed batches S3 cannot take (an outage), until it can: a directory
    # on beat's own disk, <output_dir>/.spool by default (a job name never starts with a dot).
    spool_dir: Path | None = None
    # Dispatch stops (take.lua) while Redis's used_memory is at or above this share of its
    # maxmemory (docker-compose.yml sets one), so that the rows of the requests already in
    # flight still fit before Redis, with noeviction, refuses writes. No maxmemory: no check.
    redis_memory_hold_ratio: float = Field(0.8, gt=0, le=1)
    # Workers and beat refuse a Redis that persists nothing (neither AOF nor RDB): its restart
    # loses the whole ledger. True accepts that (a throw-away run).
    allow_no_persistence: bool = False

    # launch_node.py's --simulate and --sim-args, for a deployment's own commands (a cluster's
    # manifests, docs/CLUSTER.md) run without GPUs: the project's simulated servers.
    simulate: bool = False
    sim_args: str = ""

    # This node's name: a GPU is named by its node and local index ("gpu3@node-a"), unique in the
    # deployment, and so are its queue and its Celery worker. Slurm's name for it, else the
    # host's short name, by default (default_node_name).
    node: str = Field(default_factory=lambda: default_node_name())

    # The SGLang server a worker calls: DFLASH_SGLANG_URL pins it; otherwise the GPU's local
    # index picks http://{sglang_host}:{sglang_base_port + index}, the layout
    # workers/launch_node.py starts.
    sglang_url: str | None = None
    sglang_host: str = "127.0.0.1"
    sglang_base_port: int = 30000

    # HTTP client. A thinking-mode generation of 8,192 tokens behind a full server can take many
    # minutes, so the read timeout is long; SGLang drops idle keep-alive connections after 5 s, so
    # ours expire first.
    connect_timeout_s: float = 10.0
    request_timeout_s: float = 1800.0
    keepalive_expiry_s: float = 4.0

    # Dispatch: each GPU queue holds its worker's concurrency plus this share of it in reserve,
    # so a finished request is replaced from the broker at once while Redis holds no backlog.
    window_factor: float = 1.5
    default_concurrency: int = 64

    # Retries of transient failures: exponential backoff with full jitter, back on the same GPU's
    # queue. Only requests actually sent count (a prompt held back by an open circuit breaker
    # spends no attempt). 20 retries: even without the breaker, the waits of a prompt add up to
    # less than five minutes fewer than once in 10^5 (none in 400,000 draws; the median is 15
    # minutes), so a server down for five minutes costs no prompt. A waiting retry is an
    # ETA message held unacknowledged in the worker: keep retry_cap_s far below the visibility
    # timeout.
    retry_base_s: float = 2.0
    retry_cap_s: float = 120.0
    max_retries: int = 20

    # Circuit breaker, per worker process and server: after this many consecutive transient
    # failures the worker stops sending requests, probes /health (backoff from probe_base_s to
    # probe_cap_s) and resumes after breaker_close_after consecutive 200s. A task waits for the
    # breaker at most breaker_wait_s, then puts its prompt back in the queue (no attempt spent).
    breaker_threshold: int = 10
    breaker_close_after: int = 3
    breaker_probe_base_s: float = 1.0
    breaker_probe_cap_s: float = 30.0
    breaker_wait_s: float = 600.0
    # A GPU whose breaker stays open this long (its server does not answer, its worker lives)
    # has its prompts handed to the job's other GPUs by beat; one opened for a misconfigured
    # server, at once.
    breaker_handover_s: float = 60.0

    # The end game (dispatch/lua/take.lua): a GPU this much faster than another (its requests'
    # output tokens/s, a moving average in which each request weighs speed_average_weight) takes
    # the other's queued prompts, is left the last ones, and has a generation running there
    # moved to it; an order to move one that its worker has not carried out in
    # migration_order_lapse_s lapses.
    endgame_faster_ratio: float = Field(1.15, gt=1.0)
    speed_average_weight: float = Field(0.05, gt=0.0, le=1.0)
    migration_order_lapse_s: float = Field(60.0, gt=0.0)
    # The end game in rounds (dispatch/window.py's round_cap): once fewer prompts are pending
    # than endgame_rounds_depth per request the job's GPUs run at once, a request runs at most
    # endgame_round_tokens further; one cut there goes on from its exact tokens in a later
    # round, behind the prompts not started yet. Each round costs a request and the prefill of
    # what the generation has (its server's prefix cache holds it when it stays there).
    # endgame_round_tokens 0: no rounds.
    endgame_round_tokens: int = Field(2048, ge=0)
    endgame_rounds_depth: float = Field(10.0, ge=0.0)

    # Warm shutdown (SIGTERM): requests in flight get this long to finish, then they are aborted
    # on the server and handed over with their partial output, which another GPU continues (0:
    # at once; a long generation is neither thrown away nor waited for). Below the deployments'
    # stop grace period (5 minutes in docker-compose.yml and workers/launch_node.py).
    shutdown_grace_s: float = 0.0

    # A task whose Redis goes away (a Redis restart) retries its ledger writes this long before
    # giving up; its message is then redelivered after the visibility timeout.
    redis_outage_s: float = 300.0
    # How often workers look for unacknowledged messages older than the visibility timeout
    # (kombu's restore sweep; kombu's default is about every 100 s).
    unacked_restore_interval_s: int = 10

    # Batches: sealed at this many rows or bytes, or when the oldest waiting row is this old.
    batch_rows: int = 1000
    batch_bytes: int = 64 * 1024 * 1024
    batch_max_age_s: float = 300.0

    # Each GPU worker samples its server's /metrics this often (status, progress.json).
    server_metrics_interval_s: float = 2.0

    progress_interval_s: float = Field(5.0, description="beat period of progress.json and batches")
    rate_window_s: float = 300.0

    # S3 (on when s3_uri is set). Credentials, region, endpoint (AWS_ENDPOINT_URL) and retries
    # (AWS_MAX_ATTEMPTS) come from boto3's standard chain, never from here. Objects at or above
    # the threshold go up as parallel multipart uploads of this part size.
    s3_multipart_threshold_bytes: int = 8 * 1024 * 1024
    s3_multipart_chunk_bytes: int = 8 * 1024 * 1024
    s3_max_concurrency: int = 4
    s3_connect_timeout_s: float = 10.0
    s3_read_timeout_s: float = 60.0

    # Beat's per-job locks (tick, batch sealing) expire this long after their holder stops
    # renewing them (a beat killed mid-tick); a live holder renews them every third of it.
    lock_ttl_s: float = 60.0

    # A GPU worker refreshes its heartbeat this often; progress.json calls it alive while the
    # last one is under three periods old.
    worker_heartbeat_s: float = 5.0

    # A prompt dispatched this long ago and still not done has lost its message (a broker restart
    # without persistence): the reaper dispatches it again. Longer than the visibility timeout, so
    # Celery's own redelivery goes first.
    visibility_timeout_s: int = 4 * 3600
    reap_after_s: int = 5 * 3600
    # A prompt in flight this long with no task message for it anywhere (its GPU's queue, or
    # unacknowledged in a worker) lost it to a broker crash (a Redis restart with appendfsync
    # everysec can lose the last second of writes): beat's maintain, every maintain_interval_s,
    # dispatches it again. Two looks a second apart cover a message on its way between places.
    lost_message_grace_s: float = 20.0
    maintain_interval_s: float = 10.0
    # A GPU whose worker has not stamped its heartbeat for this long (killed, its node lost,
    # never started) gets nothing new, and the prompts dispatched to it before then go back to
    # pending for the job's other GPUs. Longer than a worker restart takes.
    worker_gone_after_s: int = 180

    # Training runs (manage.py train): their directories (checkpoints, train.log, metrics.jsonl,
    # the export a command trainer reads) on the training node, under train_dir or else
    # <output_dir>/training. A running run's task stamps a heartbeat every train_heartbeat_s;
    # beat queues a run whose heartbeat is older than train_stale_s again (its worker died: the
    # trainer resumes from its last checkpoint), at most train_max_restarts times.
    train_dir: Path | None = None
    # The command lines a training node runs, by name, and the variables a run's env may set
    # there: a TOML file on that node (training/queue/spec.py, node_commands; docs/SECURITY.md).
    # A run's spec, from Redis, only names a template; without the file a node runs only the
    # built-in `specforge`.
    train_templates: Path | None = None
    train_heartbeat_s: float = 10.0
    train_stale_s: float = 300.0
    train_max_restarts: int = 3

    # A starting worker waits this long for its SGLang server's /health (a large model loads for
    # many minutes), then takes work anyway and lets its breaker handle a server still down.
    health_wait_s: float = 3600.0

    # `manage.py flower`'s basic auth: user:password[,user2:password2]. A secret: never logged.
    flower_basic_auth: SecretStr | None = None

    # For tests only, empty in production: named points in the code where a process pauses, to
    # force an interleaving the test wants (`failpoint`). "name=sleep:0.5,other=sleep:0-2,
    # third=hold:/path" (hold: create /path.reached, then wait while /path exists).
    failpoints: str = ""

    @field_validator("s3_uri")
    @classmethod
    def _s3_uri_is_usable(cls, uri: str | None) -> str | None:
        if uri:  # empty: no S3
            parse_s3_uri(uri)
        return uri or None

    @field_validator("output_dir", mode="before")
    @classmethod
    def _output_dir_is_a_directory(cls, value):
        if isinstance(value, str):
            if check_location(value).startswith("s3://"):
                raise ValueError(f"{value!r} is an S3 URI: set DFLASH_S3_URI to it, and leave "
                                 "DFLASH_OUTPUT_DIR a directory")
        return value

    @field_validator("node")
    @classmethod
    def _node_name(cls, value: str) -> str:
        return check_node_name(value)

    @field_validator("sglang_url")
    @classmethod
    def _sglang_url_is_usable(cls, url: str | None) -> str | None:
        return check_http_url(url) if url else None

    @field_validator("redis_url")
    @classmethod
    def _redis_url_is_usable(cls, url: str) -> str:
        sentinel_nodes(url)  # a malformed sentinel:// URL fails here, with what to write instead
        return url

    def redis_password_value(self) -> str | None:
        """The Redis servers' password in clear, for the clients that send it (never logged)."""
        return self.redis_password.get_secret_value() if self.redis_password else None

    def sentinels(self) -> tuple[list[tuple[str, int]], int] | None:
        """The sentinels (host, port) and the database of a sentinel:// redis_url; None for any
        other URL (the validator has refused a malformed one)."""
        return sentinel_nodes(self.redis_url)

    def sentinel_kwargs(self) -> dict:
        """redis-py's arguments for the connections to the sentinels (kombu's and Celery's
        `sentinel_kwargs` too): their password, and timeouts, so that a sentinel that hangs is
        given up for the next one instead of stalling a reconnect."""
        secret = self.redis_sentinel_password
        return {"socket_timeout": 5.0, "socket_connect_timeout": 5.0,
                **({"password": secret.get_secret_value()} if secret else {})}

    def failpoint(self, name: str) -> None:
        """Pause here if a test asked to (DFLASH_FAILPOINTS): the chaos test widens the window
        between a read and the write that depends on it; a test holds a process at a point,
        acts, then lets it go on. Nothing at all when the setting is empty."""
        if not self.failpoints:
            return
        for item in self.failpoints.split(","):
            point, _, action = item.partition("=")
            if point.strip() != name:
                continue
            kind, _, arg = action.partition(":")
            if kind == "sleep":
                low, _, high = arg.partition("-")
                time.sleep(random.uniform(float(low), float(high or low)))
            elif kind == "hold":
                gate = Path(arg)
                Path(f"{arg}.reached").touch()
                deadline = time.monotonic() + 600
                while gate.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)

    def output_location(self) -> str:
        """Where a new job's batches go, as the job keeps it: the S3 URI, else the output
        directory made absolute (a relative one names a different place in every directory)."""
        return self.s3_uri or str(self.output_dir.resolve())

    def spool_path(self) -> Path:
        return self.spool_dir or self.output_dir / ".spool"

    def training_dir(self) -> Path:
        return self.train_dir or self.output_dir / "training"

    def longest_unacked_s(self) -> float:
        """The longest a prompt's message can stay unacknowledged in a healthy worker: a request
        to its timeout, its retry wait, a wait on an open breaker. The visibility timeout must
        exceed it, or the broker delivers the message again while it is still being worked on."""
        return (self.connect_timeout_s + self.request_timeout_s + self.retry_cap_s
                + self.breaker_wait_s)

    def sglang_url_for(self, gpu: GpuName) -> str:
        """The server of a GPU of this node, by its name ("gpu3@node-a")."""
        port = self.sglang_base_port + gpu.local_index
        return self.sglang_url or f"http://{self.sglang_host}:{port}"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()


def describe_invalid(exc: ValidationError) -> str:
    """A settings error as an operator reads it: each variable named as it is set
    (DFLASH_S3_URI), with what is wrong, never the value (it may hold a password)."""
    problems = []
    for error in exc.errors():
        field_name = str(error["loc"][0]) if error.get("loc") else "?"
        message = str(error.get("msg", "")).removeprefix("Value error, ")
        problems.append(f"DFLASH_{field_name.upper()}: {message}")
    return "; ".join(problems)


SENTINEL_PORT = 26379
# A bucket name as S3 allows it: 3 to 63 lower-case letters, digits, dots and hyphens.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """("bucket", "prefix") from "s3://bucket/prefix" (the prefix may be empty); ValueError
    naming what is wrong otherwise (s3:/bucket, a bucket name S3 refuses)."""
    parts = urlsplit(uri)
    if parts.scheme != "s3" or not parts.netloc or not uri.startswith("s3://"):
        raise ValueError(f"not an S3 URI: {uri!r} (expected s3://bucket/prefix)")
    if not _BUCKET.match(parts.netloc):
        raise ValueError(f"{uri!r}: {parts.netloc!r} is not a bucket name (3 to 63 lower-case "
                         "letters, digits, '.' and '-')")
    return parts.netloc, parts.path.strip("/")


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_S3_TYPO = re.compile(r"^s3[an]?(:/{0,1}(?!/)|:?//)", re.IGNORECASE)


def check_location(where: str) -> str:
    """A storage location as given (--output, --from, DFLASH_OUTPUT_DIR): an s3://bucket/prefix
    URI, or a local path that cannot be mistaken for one. `s3:/b/p`, `s3//b/p`, `S3://b/p` or
    `s3a://b/p` would otherwise name a local directory and keep the job's batches there for
    good: ValueError with the URI meant; another scheme (gs://, file:) is refused too."""
    if where.startswith("s3://"):
        parse_s3_uri(where)
        return where
    if _S3_TYPO.match(where):
        meant = "s3://" + _S3_TYPO.sub("", where).lstrip("/")
        raise ValueError(f"{where!r} looks like a mistyped S3 URI: write {meant}")
    if scheme := _SCHEME.match(where):
        raise ValueError(f"{where!r}: {scheme.group(1)}: is not a storage this project writes "
                         "(a directory, or s3://bucket/prefix)")
    return where


def check_http_url(url: str) -> str:
    """A server's base URL, http(s)://HOST[:PORT]: ValueError naming what is wrong otherwise
    (`localhost:30000` would be taken as a scheme, `http//host` as a relative path)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{redact_url(url)!r} is not a server URL: write http://HOST:PORT")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"{redact_url(url)!r}: the port is not a number from 0 to 65535") from None
    return url


def default_node_name() -> str:
    """This node's name when DFLASH_NODE does not give one: Slurm's name for it in an
    allocation (SLURMD_NODENAME: unique in the cluster, and the name `scontrol` and `sinfo`
    show), else the host's short name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0] or "localhost"


def sentinel_nodes(url: str) -> tuple[list[tuple[str, int]], int] | None:
    """The sentinels, as (host, port), and the db of a `sentinel://` URL (kombu's syntax, several
    joined by `;`); None for any other URL. Raises ValueError for one that kombu, Celery and
    redis-py would not read alike."""
    chunks = [chunk.strip() for chunk in url.split(";") if chunk.strip()]
    if not chunks or urlsplit(chunks[0]).scheme != "sentinel":
        return None
    nodes, dbs = [], []
    for chunk in chunks:
        parts = urlsplit(chunk)
        if parts.scheme != "sentinel" or not parts.hostname:
            raise ValueError(f"{redact_url(chunk)}: each part of a Sentinel URL is "
                             "sentinel://host[:port][/db], joined by ';'")
        if parts.username or parts.password is not None:
            raise ValueError(f"{redact_url(chunk)}: no credentials in a Sentinel URL; set "
                             "DFLASH_REDIS_PASSWORD (the master's) and DFLASH_REDIS_SENTINEL_PASSWORD")
        nodes.append((parts.hostname, parts.port or SENTINEL_PORT))
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ValueError(f"{redact_url(chunk)}: the db is a number")
        dbs.append(int(db) if db else 0)
    if len(set(dbs)) > 1:
        raise ValueError(f"{redact_url(url)}: kombu reads the db of the sentinel it connects "
                         "through, Celery the first one's: give the same db on every sentinel "
                         "(none means 0)")
    return nodes, dbs[0]


def redact_url(url: str) -> str:
    """The URL with any password replaced, for logs and error messages; each part of a
    `;`-joined one (Sentinel)."""
    if ";" in url:
        return ";".join(redact_url(chunk) for chunk in url.split(";"))
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
