"""When a prompt whose request failed is sent again, and when it stops being sent: the retry
policy of the failure classes (sglang/errors.py). A transient failure is retried on the same
GPU's queue after an exponential backoff with full jitter, up to `max_retries` requests; then the
prompt goes to the failed registry. A permanent one is not retried; the deployment's is no
attempt at all (the GPU's breaker trips). A wait that sent nothing (a prompt text the storage
cannot give yet) backs off the same way and spends no attempt."""
from __future__ import annotations

import random
from dataclasses import dataclass

from dflash_tasks.core.settings import Settings


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    base_s: float
    cap_s: float
    max_retries: int

    @classmethod
    def from_settings(cls, s: Settings) -> "RetryPolicy":
        return cls(base_s=s.retry_base_s, cap_s=s.retry_cap_s, max_retries=s.max_retries)

    def backoff_s(self, retries: int) -> float:
        """Full jitter under an exponential cap: spreads the retries of many prompts that failed
        together (a server restart) instead of sending them back at once."""
        return random.uniform(0, min(self.cap_s, self.base_s * 2 ** retries))

    def retries(self, attempt: int) -> bool:
        """Whether a transient failure of request number `attempt` is sent again."""
        return attempt <= self.max_retries
