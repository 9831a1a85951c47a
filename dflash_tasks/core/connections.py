"""The process's Redis client (thread-safe; redis-py's pool re-opens after a fork), on one Redis
or on the master Redis Sentinel names, and the check that its Redis persists."""
from __future__ import annotations

import logging
import time
from functools import lru_cache
from typing import Callable, TypeVar

import redis
from redis.sentinel import Sentinel

from dflash_tasks.core.settings import Settings, get_settings, redact_url

log = logging.getLogger(__name__)
T = TypeVar("T")


@lru_cache(maxsize=1)
def redis_client() -> redis.Redis:
    return connect(get_settings(), health_check_interval=30, socket_keepalive=True,
                   retry_on_timeout=True)


def connect(s: Settings, **options) -> redis.Redis:
    """A client of s.redis_url with s's password. For a sentinel:// URL, a client of the master
    of s.redis_master_name: each new connection asks the sentinels where the master is, and a
    connection to a master that went away (or became a replica) is dropped, so the client
    follows a failover by itself (a command that was on the lost connection fails; the
    callers' retries cover that)."""
    password = s.redis_password_value()
    found = s.sentinels()
    if found is None:
        return redis.Redis.from_url(s.redis_url, password=password, **options)
    nodes, db = found
    return Sentinel(nodes, sentinel_kwargs=s.sentinel_kwargs()).master_for(
        s.redis_master_name, db=db, password=password, **options)


class PersistenceError(RuntimeError):
    """Redis would lose the ledger on a restart; the message names the settings and the flag."""


def check_persistence(r: redis.Redis, s: Settings) -> None:
    """Refuse a Redis with neither AOF nor RDB snapshots: a restart of it loses every prompt's
    state (pending, in flight, done marks, the rows waiting to be sealed), and nothing can tell
    which prompts were generated. DFLASH_ALLOW_NO_PERSISTENCE=1 allows it anyway (a throw-away
    run). A Redis whose CONFIG command is disabled (a managed service) cannot be checked: a
    warning says so."""
    if s.allow_no_persistence:
        return
    try:
        config = {**r.config_get("appendonly"), **r.config_get("save")}
    except redis.ResponseError as exc:
        log.warning("cannot check the persistence of Redis at %s (%s); make sure it has AOF or RDB",
                    redact_url(s.redis_url), exc)
        return
    if config.get("appendonly") != "yes" and not (config.get("save") or "").strip():
        raise PersistenceError(
            f"Redis at {redact_url(s.redis_url)} persists nothing (appendonly no, save \"\"): a "
            "restart would lose every prompt's state. Run it with `--appendonly yes --appendfsync "
            "everysec` (docker-compose.yml does), or set DFLASH_ALLOW_NO_PERSISTENCE=1 to accept "
            "that for a throw-away run")


# A Redis that restarts, or a Sentinel failover, shows as these for a while (BusyLoadingError,
# while it loads its data, is a ConnectionError).
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


def through_outage(what: str, outage_s: float, fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs), waiting out a Redis restart for up to `outage_s`. Only for
    operations that are idempotent (every ledger script is, per prompt): one that succeeded
    before its reply was lost may run again."""
    deadline = time.monotonic() + outage_s
    delay = 0.5
    while True:
        try:
            return fn(*args, **kwargs)
        except REDIS_DOWN as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("Redis unavailable during %s (%s); retrying in %.1fs", what, exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
