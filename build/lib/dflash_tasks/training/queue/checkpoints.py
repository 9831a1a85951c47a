"""The checkpoints a trainer wrote, and their upload to S3.

A checkpoint is an entry (a directory, or a file) directly under the run's checkpoint
directory: the reference trainer writes `step_00001000/` (renamed into place when complete),
SpecForge 0.2.0 writes `<run_id>-step1000/`. Hidden entries and temporary names are a checkpoint
being written and are left alone.

With DFLASH_S3_URI set, each goes to `<prefix>/<job>/training/<run>/checkpoints/<name>/...`,
once (the run remembers which it uploaded, so a resumed run does not send them again).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

from dflash_tasks.output.storage import S3Storage, StorageError

log = logging.getLogger(__name__)
_STEP = re.compile(r"step_?(\d+)")


def _step(name: str) -> int | None:
    found = _STEP.search(name)
    return int(found.group(1)) if found else None


def _by_step(checkpoint: dict) -> tuple:
    return checkpoint["step"] is None, checkpoint["step"] or 0, checkpoint["name"]


def listed(directory: Path) -> list[dict]:
    """The finished checkpoints under `directory`, oldest step first."""
    if not directory.is_dir():
        return []
    out = []
    for entry in directory.iterdir():
        if entry.name.startswith(".") or "tmp" in entry.name or entry.name.endswith(".partial"):
            continue
        # SpecForge's <run_id>-latest/-best links name a checkpoint listed already, and its
        # <run_id>.best_meta.json is bookkeeping: a file without a step is not a checkpoint.
        if entry.is_symlink() or (entry.is_file() and _step(entry.name) is None):
            continue
        out.append({"name": entry.name, "path": str(entry), "step": _step(entry.name)})
    return sorted(out, key=_by_step)


def s3_prefix(job: str, run: str) -> str:
    return f"{job}/training/{run}/checkpoints"


def upload(storage: S3Storage, job: str, run: str, checkpoint: dict) -> str:
    """Upload one checkpoint, file by file; returns its S3 location. Raises StorageError, or
    FileNotFoundError when the trainer deleted it meanwhile (rotation of old checkpoints)."""
    root = Path(checkpoint["path"])
    if not root.exists():
        raise FileNotFoundError(root)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    key = f"{s3_prefix(job, run)}/{checkpoint['name']}"
    for path in files:
        rel = "" if path == root else "/" + path.relative_to(root).as_posix()
        storage.put_file(key + rel, path)
    return storage.location(key)


def upload_new(storage: S3Storage | None, job: str, run: str, directory: Path,
               uploaded: dict[str, str]) -> list[dict]:
    """Upload the checkpoints not in `uploaded` (name -> S3 location, updated in place); returns
    every checkpoint, with its `uri` when it is in S3 (an uploaded one the trainer has since
    rotated away is kept, with no local path). A failed upload is logged and tried again at the
    next call."""
    found = listed(directory)
    for ckpt in found:
        if storage is not None and ckpt["name"] not in uploaded:
            try:
                uploaded[ckpt["name"]] = upload(storage, job, run, ckpt)
                log.info("run %s: checkpoint %s uploaded to %s", run, ckpt["name"],
                         uploaded[ckpt["name"]])
            except FileNotFoundError:
                continue  # rotated away by the trainer while we listed it
            except StorageError as exc:
                log.warning("run %s: checkpoint %s not uploaded (tried again later): %s", run,
                            ckpt["name"], exc)
        ckpt["uri"] = uploaded.get(ckpt["name"])
    names = {c["name"] for c in found}
    gone = [{"name": n, "path": None, "step": _step(n), "uri": uri}
            for n, uri in uploaded.items() if n not in names]
    return sorted(gone + found, key=_by_step)
