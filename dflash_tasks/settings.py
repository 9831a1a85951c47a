"""Process-wide configuration, read once from the environment (DFLASH_*).

Per-job generation parameters (max tokens, sampling, thinking) are not here: they belong to the
job and live in Redis, so `manage.py set` reaches every worker without a restart.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DFLASH_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    output_dir: Path = Path("output")
    s3_uri: str | None = None

    # The SGLang server a worker calls: DFLASH_SGLANG_URL pins it; otherwise the GPU index picks
    # http://{sglang_host}:{sglang_base_port + gpu}, the layout workers/launch_node.py starts.
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

    # Retries of transient failures: exponential backoff with full jitter.
    retry_base_s: float = 2.0
    retry_cap_s: float = 120.0
    max_retries: int = 12

    # Batches: sealed at this many rows or bytes, or when the oldest waiting row is this old.
    batch_rows: int = 1000
    batch_bytes: int = 64 * 1024 * 1024
    batch_max_age_s: float = 300.0

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

    def sglang_url_for(self, gpu: int) -> str:
        return self.sglang_url or f"http://{self.sglang_host}:{self.sglang_base_port + gpu}"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()


def redact_url(url: str) -> str:
    """The URL with any password replaced, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
