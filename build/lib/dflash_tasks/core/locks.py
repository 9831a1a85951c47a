"""A Redis lock held for as long as its holder lives, for beat's per-job work.

The lock has a short TTL that a daemon thread keeps renewing while the holder works, so a long
upload never loses it, and a holder that dies (SIGKILL, os._exit, a lost node) frees it within
one TTL, without the half-hour wait a fixed long TTL would impose on the next beat. A holder
checks `still_held()` before each step that changes shared state: a holder stalled for longer
than the TTL (a paused VM) learns it lost the lock and stops, instead of racing its successor.
"""
from __future__ import annotations

import logging
import threading

import redis

log = logging.getLogger(__name__)


class LockLost(RuntimeError):
    pass


class HeldLock:
    def __init__(self, r: redis.Redis, name: str, ttl_s: float):
        self.name = name
        self.ttl_s = max(1.0, float(ttl_s))
        # thread_local=False: the renewal thread must see the token the holder acquired.
        self._lock = r.lock(name, timeout=self.ttl_s, blocking=False, thread_local=False)
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> bool:
        if not self._lock.acquire():
            return False
        self._thread = threading.Thread(target=self._renew, name=f"renew {self.name}", daemon=True)
        self._thread.start()
        return True

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self._lock.reacquire()
            except redis.exceptions.LockError:
                log.error("lock %s lost (held past its TTL by a stalled process?)", self.name)
                self._lost.set()
                return
            except redis.exceptions.RedisError as exc:  # Redis briefly away: try again
                log.warning("lock %s: renewal failed (%s)", self.name, exc)

    def still_held(self) -> None:
        """Raise LockLost unless this process still holds the lock."""
        if self._lost.is_set() or not self._lock.owned():
            self._lost.set()
            raise LockLost(f"lock {self.name} was lost")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self._lock.release()
        except redis.exceptions.LockError:
            log.warning("lock %s: already expired at release", self.name)

    def __enter__(self) -> "HeldLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
