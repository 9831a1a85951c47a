"""Where sealed batches, manifests and progress.json go: a local directory, or S3 when
DFLASH_S3_URI is set. Keys are relative paths such as "<job>/batches/<name>.jsonl.zst".

S3 credentials, region and endpoint come from boto3's own standard chain only (environment,
profiles, instance roles; AWS_ENDPOINT_URL or AWS_ENDPOINT_URL_S3 for MinIO and other
S3-compatible stores; AWS_MAX_ATTEMPTS and AWS_RETRY_MODE for retries): nothing here reads or
logs a credential.
"""
from __future__ import annotations

import base64
import hashlib
import io
import os
import shutil
import tempfile
import threading
from functools import cached_property, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from dflash_tasks.core.settings import Settings, check_location, parse_s3_uri, redact_url

if TYPE_CHECKING:
    from dflash_tasks.core.jobs import Job


def process_umask() -> int:
    """The process's umask, so files are created with the permissions any other file of the
    process gets (0644 under the usual 022). Linux says it in /proc; elsewhere os.umask can only
    read it by setting it, and sets it back at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class StorageError(RuntimeError):
    """A storage operation failed; the message names the object's location, never a credential."""


class StorageNotFound(StorageError, FileNotFoundError):
    """The object does not exist here: gone, or its directory not mounted on this node (a
    reader cannot tell them apart)."""


class StorageCorrupt(StorageError):
    """The object is there but not as its references say: shorter than a ranged read expects,
    or the range lies outside it. Waiting will not mend it."""


class StorageDenied(StorageError):
    """The storage refuses this process (no credentials, access denied, a key it does not know,
    a file this user may not read): the deployment's fault, not an object's, and waiting will
    not mend it either."""


# S3 error codes of a refusal that no retry mends (botocore's NoCredentialsError has none).
DENIED_CODES = frozenset({"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                          "ExpiredToken", "InvalidToken", "AllAccessDisabled", "AccountProblem"})


class Storage(Protocol):
    def put(self, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def get_range(self, key: str, offset: int, length: int) -> bytes: ...
    def delete_prefix(self, key_prefix: str) -> int: ...
    def delete_keys(self, keys: list[str]) -> int: ...
    def list(self, key_prefix: str) -> list[str]: ...
    def exists(self, key: str) -> bool: ...
    def location(self, key: str) -> str: ...


def write_whole(path: Path, data: bytes, *, mode: int | None = None,
                sync_dir: bool = False) -> None:
    """`data` at `path`, whole or not at all: written to a temporary file beside it, fsync'd, and
    renamed into place, so a reader never sees half a file (with `mode`, the file's permissions).
    With `sync_dir` the rename is fsync'd too: the file then survives a power cut. A full disk
    (ENOSPC) raises OSError and leaves nothing behind."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage:
    """Files under a root directory, each written to a temporary file and renamed into place,
    so a reader never sees half a file."""

    is_remote = False

    def __init__(self, root: Path):
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        """root/key, refused when it leads outside root (a key built from stored data). Checked
        on the path's text, so a root holding symlinked directories keeps working."""
        path = self.root / key
        if os.path.isabs(key) or os.path.normpath(key).split(os.sep)[0] in ("..", ""):
            raise StorageError(f"{path}: the key {key!r} leads outside {self.root}: refused")
        return path

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        # mkstemp's 0600 would keep the data from its readers
        write_whole(path, data, mode=self._mode)

    @cached_property
    def _mode(self) -> int:
        """New files' permissions: read once, when the first file is written (a worker makes a
        LocalStorage per prompt text it reads, and reads never need it)."""
        return 0o666 & ~process_umask()

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise StorageNotFound(f"{self.location(key)}: no such file") from None

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """`length` bytes at `offset`: exactly those, or StorageError (a truncated file)."""
        try:
            with open(self._path(key), "rb") as f:
                data = os.pread(f.fileno(), length, offset)
        except FileNotFoundError:
            raise StorageNotFound(f"{self.location(key)}: no such file") from None
        except PermissionError as exc:
            # A mode, an ACL, a root-squashing mount: refused to this node, as S3 refusing its
            # credentials, and no fault of the file's bytes.
            raise StorageDenied(f"{self.location(key)}: cannot read: {exc.strerror} (uid "
                                f"{os.getuid()})") from None
        except OSError as exc:
            raise StorageError(f"{self.location(key)}: cannot read: {exc}") from None
        if len(data) != length:
            raise StorageCorrupt(f"{self.location(key)}: {len(data)} bytes at offset {offset}, "
                                 f"expected {length} (the file is shorter than its references)")
        return data

    def delete_prefix(self, key_prefix: str) -> int:
        """Remove the directory `key_prefix` names (a key prefix ending in "/") and every file
        under it; returns how many files went."""
        directory = self._path(key_prefix.rstrip("/"))
        if not directory.is_dir():
            return 0
        files = sum(1 for p in directory.rglob("*") if p.is_file())
        shutil.rmtree(directory)
        return files

    def delete_keys(self, keys: list[str]) -> int:
        """Remove these files (one already gone is no error); returns how many went."""
        gone = 0
        for key in keys:
            try:
                self._path(key).unlink()
                gone += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise StorageError(f"{self.location(key)}: cannot remove: {exc}") from None
        return gone

    def list(self, key_prefix: str) -> list[str]:
        """Keys (relative, as put() takes them) of the files under the directory `key_prefix`
        names (ending in "/"); none when there is no such directory."""
        directory = self._path(key_prefix.rstrip("/"))
        try:
            if not directory.is_dir():
                return []
            return sorted(p.relative_to(self.root).as_posix() for p in directory.rglob("*")
                          if p.is_file())
        except OSError as exc:  # a mount that does not answer
            raise StorageError(f"{self.location(key_prefix)}: cannot list: {exc}") from None

    def exists(self, key: str) -> bool:
        return (self.root / key).exists()

    def location(self, key: str) -> str:
        return str(self.root / key)


class S3Storage:
    """Objects under s3://bucket/prefix/, through one boto3 client from the default chain.

    put() sends a content checksum S3 checks before it accepts the object: below the multipart
    threshold, the SHA-256 of the whole object (which S3 stores, so it equals the manifest's
    sha256); above it, boto3's transfer manager uploads parts in parallel, each with its own
    SHA-256 that S3 checks (S3 has no whole-object SHA-256 for multipart uploads). Every object
    also carries its hex SHA-256 as the user metadata `sha256`.
    """

    is_remote = True

    def __init__(self, uri: str, *, multipart_threshold: int = 8 * 1024 * 1024,
                 multipart_chunksize: int = 8 * 1024 * 1024, max_concurrency: int = 4,
                 connect_timeout_s: float = 10.0, read_timeout_s: float = 60.0,
                 readers: int | None = None):
        self.uri = uri
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.multipart_threshold = multipart_threshold
        self._chunksize = multipart_chunksize
        self._max_concurrency = max_concurrency
        # The transfer manager's parts, or every reading thread, each with its connection.
        self._connections = max(10, max_concurrency * 2, readers or 0)
        self._timeouts = (connect_timeout_s, read_timeout_s)
        self._client = None
        self._client_lock = threading.Lock()

    @classmethod
    def from_settings(cls, s: Settings, uri: str | None = None) -> "S3Storage":
        uri = uri or s.s3_uri
        if not uri:
            raise ValueError("no S3 URI: set DFLASH_S3_URI=s3://bucket/prefix")
        return _s3_for(uri, s)

    # -- the client ------------------------------------------------------------------------------

    @property
    def client(self):
        """Created on first use, once per process (boto3 clients are thread-safe; sessions are
        not, so each process makes its own)."""
        with self._client_lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                connect, read = self._timeouts
                # Retries are left to the chain (AWS_MAX_ATTEMPTS, AWS_RETRY_MODE, the profile).
                self._client = boto3.session.Session().client(
                    "s3", config=Config(connect_timeout=connect, read_timeout=read,
                                        max_pool_connections=self._connections))
            return self._client

    def _transfer_config(self):
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(multipart_threshold=self.multipart_threshold,
                              multipart_chunksize=self._chunksize,
                              max_concurrency=self._max_concurrency, use_threads=True)

    def check(self, *, bucket: bool, named: str = "DFLASH_S3_URI") -> str | None:
        """What stops this process from using the storage at all, named by the setting that
        chose it (`named`), or None: no credentials in boto3's chain; with `bucket`, a bucket
        that refuses them or does not exist. An endpoint that does not answer is not such a
        fault (an outage: beat's spool rides it out)."""
        import boto3

        if boto3.session.Session().get_credentials() is None:
            return (f"{named}={self.uri} but no AWS credentials on this node: set "
                    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance role")
        if not bucket:
            return None
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as exc:
            err = self._error("check", "", exc)
            if isinstance(err, StorageDenied):
                return f"{named}={self.uri}: the bucket {self.bucket} refuses these credentials"
            if isinstance(err, StorageNotFound):
                return f"{named}={self.uri}: there is no bucket {self.bucket}"
        return None

    def key_for(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def location(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.key_for(key)}"

    def endpoint(self) -> str:
        return redact_url(self.client.meta.endpoint_url)

    # -- the protocol ----------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        digest = hashlib.sha256(data).digest()
        extra = {"Metadata": {"sha256": digest.hex()}}
        if len(data) < self.multipart_threshold:
            extra["ChecksumSHA256"] = base64.b64encode(digest).decode()
        else:
            extra["ChecksumAlgorithm"] = "SHA256"
        if key.endswith(".json"):
            extra["ContentType"] = "application/json"
        elif key.endswith(".zst"):
            extra["ContentType"] = "application/zstd"
        try:
            self.client.upload_fileobj(io.BytesIO(data), self.bucket, self.key_for(key),
                                       ExtraArgs=extra, Config=self._transfer_config())
        except Exception as exc:  # botocore, boto3 and s3transfer errors alike
            raise self._error("upload", key, exc) from None

    def put_file(self, key: str, path: Path) -> None:
        """A file of any size (a checkpoint's weights), streamed from disk by the transfer
        manager in parallel parts, each checked by S3 against its SHA-256."""
        try:
            self.client.upload_file(str(path), self.bucket, self.key_for(key),
                                    ExtraArgs={"ChecksumAlgorithm": "SHA256"},
                                    Config=self._transfer_config())
        except Exception as exc:
            raise self._error("upload", key, exc) from None

    def get(self, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.key_for(key))["Body"].read()
        except Exception as exc:
            raise self._error("download", key, exc) from None

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """`length` bytes at `offset`, by a ranged GET: exactly those, or StorageError."""
        try:
            data = self.client.get_object(Bucket=self.bucket, Key=self.key_for(key),
                                          Range=f"bytes={offset}-{offset + length - 1}")["Body"].read()
        except Exception as exc:
            raise self._error("download", key, exc) from None
        if len(data) != length:
            raise StorageCorrupt(f"S3 download {self.location(key)}: {len(data)} bytes at offset "
                                 f"{offset}, expected {length} (the object is shorter than its "
                                 "references)")
        return data

    def delete_prefix(self, key_prefix: str) -> int:
        """Remove every object under a relative prefix; returns how many went."""
        return self.delete_keys(self.list(key_prefix))

    def delete_keys(self, keys: list[str]) -> int:
        """Remove these objects (one already gone is no error: S3 answers the same); returns
        how many were asked."""
        for first in range(0, len(keys), 1000):  # DeleteObjects takes 1,000 keys at most
            batch = keys[first:first + 1000]
            try:
                answer = self.client.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": [{"Key": self.key_for(k)} for k in batch], "Quiet": True})
            except Exception as exc:
                raise self._error("delete", batch[0], exc) from None
            if answer.get("Errors"):
                first_error = answer["Errors"][0]
                raise StorageError(f"S3 delete {self.location(batch[0])} and "
                                   f"{len(batch) - 1} more: {len(answer['Errors'])} objects not "
                                   f"deleted, the first {first_error.get('Key')}: "
                                   f"{first_error.get('Code')}")
        return len(keys)

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self.key_for(key))
            return True
        except Exception as exc:
            err = self._error("head", key, exc)
            if isinstance(err, StorageNotFound):
                return False
            raise err from None

    def list(self, key_prefix: str) -> list[str]:
        """Keys (relative, as put() takes them) under a relative prefix."""
        full = self.key_for(key_prefix)
        strip = len(self.prefix) + 1 if self.prefix else 0
        out: list[str] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=full):
                out.extend(obj["Key"][strip:] for obj in page.get("Contents", []))
        except Exception as exc:
            raise self._error("list", key_prefix, exc) from None
        return out

    def _error(self, action: str, key: str, exc: Exception) -> StorageError:
        code = ""
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
        reason = f"{type(exc).__name__}: {exc}"
        where = self.location(key)
        if code == "NoSuchBucket":
            return StorageNotFound(f"S3 {action} {where}: there is no bucket {self.bucket}")
        if code in ("404", "NoSuchKey", "NotFound"):
            return StorageNotFound(f"S3 {action} {where}: no such object")
        if code in ("416", "InvalidRange"):
            return StorageCorrupt(f"S3 {action} {where}: the range lies outside the object (it "
                                  "is shorter than its references)")
        if code in DENIED_CODES:
            return StorageDenied(f"S3 {action} {where} refused ({code}): check this node's AWS "
                                 "credentials and the bucket's policy")
        if type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
            return StorageDenied(f"S3 {action} {where}: no AWS credentials on this node (set "
                                 "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an "
                                 "instance role)")
        return StorageError(f"S3 {action} {where} failed: {redact_url(reason)}")


def storage_for(settings: Settings) -> Storage:
    """Where batches and the manifest go: S3 when DFLASH_S3_URI is set, else the output dir."""
    if settings.s3_uri:
        return _s3_for(settings.s3_uri, settings)
    return LocalStorage(settings.output_dir)


def job_output(job: Job, settings: Settings) -> Storage:
    """Where this job's batches go and are read from: the location it keeps (made absolute when
    it was enqueued), or the deployment's for a job made before jobs kept one."""
    return storage_at(job.output, settings) if job.output else storage_for(settings)


def check_output(where: str, settings: Settings, *, named: str) -> str:
    """A new job's output location as the job keeps it: an s3:// URI whose bucket takes this
    node's credentials, or a directory made absolute that this process can create or write.
    Raises ValueError naming the setting (`named`) and the problem; creates nothing."""
    try:
        check_location(where)  # a mistyped scheme, or an S3 URI that is not one
    except ValueError as exc:
        raise ValueError(f"{named}: {exc}") from None
    if where.startswith("s3://"):
        problem = _s3_for(where, settings).check(bucket=True, named=named)
        if problem:
            raise ValueError(problem)
        return where
    if "://" in where:
        raise ValueError(f"{named}={where}: a directory or an s3://bucket/prefix URI")
    path = Path(where).expanduser().resolve()
    if problem := directory_problem(path):
        raise ValueError(f"{named}={where}: {problem}")
    return str(path)


def directory_problem(path: Path) -> str | None:
    """Why no directory can be made or written at `path` (absolute): the nearest existing one
    on its way is a file, or this user cannot write it. None when one can."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return (f"{existing} is not writable by this user"
                + ("" if existing == path else f" (to create {path} in it)"))
    return None


def _s3_for(uri: str, s: Settings, readers: int | None = None) -> S3Storage:
    """One S3Storage (one client, one connection pool) per URI and S3 settings per process."""
    return _s3_storage(uri, s.s3_multipart_threshold_bytes, s.s3_multipart_chunk_bytes,
                       s.s3_max_concurrency, s.s3_connect_timeout_s, s.s3_read_timeout_s, readers)


@lru_cache(maxsize=16)
def _s3_storage(uri: str, threshold: int, chunk: int, concurrency: int, connect_s: float,
                read_s: float, readers: int | None) -> S3Storage:
    return S3Storage(uri, multipart_threshold=threshold, multipart_chunksize=chunk,
                     max_concurrency=concurrency, connect_timeout_s=connect_s, read_timeout_s=read_s,
                     readers=readers)


def storage_at(where: str, settings: Settings, *, readers: int | None = None) -> Storage:
    """An explicit location: an s3:// URI or a local directory. `readers`: threads that may read
    from it at once (a GPU worker's, reading prompt texts), so its S3 connection pool holds one
    each instead of opening and dropping connections beyond it."""
    if where.startswith("s3://"):
        return _s3_for(where, settings, readers)
    return LocalStorage(Path(where))
