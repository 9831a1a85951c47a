"""The process's Redis client (thread-safe; redis-py's pool re-opens after a fork) and the check
that its Redis persists."""
from __future__ import annotations

import logging
from functools import lru_cache

import redis

from dflash_tasks.core.settings import Settings, get_settings, redact_url

log = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(get_settings().redis_url, health_check_interval=30,
                                socket_keepalive=True, retry_on_timeout=True)


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
