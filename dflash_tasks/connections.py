"""Process-wide Redis client and ledger (thread-safe; redis-py's pool re-opens after a fork)."""
from __future__ import annotations

from functools import lru_cache

import redis

from .ledger import Ledger
from .settings import get_settings


@lru_cache(maxsize=1)
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(get_settings().redis_url, health_check_interval=30,
                                socket_keepalive=True, retry_on_timeout=True)


@lru_cache(maxsize=1)
def ledger() -> Ledger:
    return Ledger(redis_client())
