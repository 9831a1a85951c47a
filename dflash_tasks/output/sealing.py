"""Sealing's steps in Redis, each one script in `lua/` (batches.py runs them in order): enter a
written batch in the manifest, remove its rows from the output stream, clear the sealing intent,
and switch a spooled batch's record to the shipped one; and the names of batches."""
from __future__ import annotations

import json
import re
from typing import Sequence

import redis

from dflash_tasks.core.keys import JobName
from dflash_tasks.core.scripts import Script

RECORD_BATCH = Script(__file__, "record_batch")
DROP_SEALED = Script(__file__, "drop_sealed")
CLEAR_SEALING = Script(__file__, "clear_sealing")
SHIP_SPOOLED = Script(__file__, "ship_spooled")
# The only names batch_name produces (a stream id's milliseconds and sequence number).
BATCH_NAME = re.compile(r"batch-\d{13}-\d{4,}")


def batch_name(first_entry_id: str) -> str:
    """A batch is named after its first row's stream entry, so a tick that dies and the one that
    takes over seal the same rows under the same name."""
    ms, seq = first_entry_id.split("-")
    return f"batch-{int(ms):013d}-{int(seq):04d}"


def _increments(counts: dict[str, int] | None) -> list:
    return [x for field, inc in (counts or {}).items() for x in (field, int(inc))]


def record_batch(r: redis.Redis, job: JobName, name: str, record: dict,
                 stats: dict[str, int] | None = None) -> bool:
    """Enter a batch in the manifest; `stats` (counter -> increment) is added with it, once."""
    return bool(RECORD_BATCH(r, manifest=job.manifest, counters=job.counters, name=name,
                             record=json.dumps(record), bytes=record["bytes"],
                             increments=_increments(stats)))


def ship_spooled(r: redis.Redis, job: JobName, name: str, spooled: str, shipped: str,
                 counts: dict[str, int]) -> bool:
    """A spooled batch is in the storage now: its manifest record `spooled` (as read) becomes
    `shipped`, and `counts` are added, once (ship_spooled.lua)."""
    return bool(SHIP_SPOOLED(r, manifest=job.manifest, counters=job.counters, name=name,
                             spooled=spooled, shipped=shipped, increments=_increments(counts)))


def drop_sealed(r: redis.Redis, job: JobName, entry_ids: Sequence[bytes | str], nbytes: int) -> int:
    """Remove a shipped batch's entries (their rows: `nbytes`, each with its newline) from the
    output stream, with their share of the unsealed counters (drop_sealed.lua)."""
    return int(DROP_SEALED(r, output=job.output, counters=job.counters, bytes=nbytes,
                           entries=entry_ids))


def clear_sealing(r: redis.Redis, job: JobName, intent: str) -> bool:
    """Clear the job's sealing intent if it is still `intent` (batches.py's last step)."""
    return bool(CLEAR_SEALING(r, sealing=job.sealing, intent=intent))
