"""What each SGLang server says about its own load, so an operator sees a server whose decode
slots are not full: every GPU worker samples its server's /metrics (running and queued requests,
generation throughput, KV-cache usage) from a daemon thread into `dflash:servers`, and status and
progress.json show it per GPU. A server started without --enable-metrics answers 404: the sample
then says so instead of the figures."""
from __future__ import annotations

import json
import logging
import threading

import redis
from prometheus_client.parser import text_string_to_metric_families

from dflash_tasks.core.keys import SERVERS, GpuName
from dflash_tasks.sglang import SGLangClient, SGLangError

log = logging.getLogger(__name__)
FAMILIES = {  # Prometheus family -> our name (SGLang 0.5.23, see tests/sglang_samples/metrics.txt)
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "queued",
    "sglang:gen_throughput": "gen_throughput",
    "sglang:token_usage": "token_usage",
    "sglang:cache_hit_rate": "cache_hit_rate",
}


def parse(text: str) -> dict[str, float]:
    """The families we read, summed over their label sets (one per TP/DP rank), with
    prometheus_client's parser of the text format (escaped label values, timestamps, exemplars:
    a sample's value is never its timestamp). A family the server does not serve is absent."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if (key := FAMILIES.get(s.name)) is not None:
                out[key] = out.get(key, 0.0) + float(s.value)
    return out


def sample(client: SGLangClient) -> dict:
    try:
        return {**parse(client.metrics_text()), "error": None}
    except SGLangError as exc:
        return {"error": str(exc)[:300]}
    except ValueError as exc:  # not the Prometheus text format
        return {"error": f"unreadable /metrics: {exc}"[:300]}


def sample_once(r: redis.Redis, gpu: GpuName, client: SGLangClient) -> dict:
    seconds, micros = r.time()
    record = {**sample(client), "at": round(seconds + micros / 1e6, 3)}
    r.hset(SERVERS, gpu, json.dumps(record))
    return record


def run(r: redis.Redis, gpu: GpuName, client: SGLangClient, interval_s: float,
        stop: threading.Event) -> None:
    """Sample gpu's server every interval_s until `stop` (the worker runtime's thread)."""
    while True:
        try:
            sample_once(r, gpu, client)
        except redis.exceptions.RedisError as exc:
            log.warning("%s: server metrics not written (%s)", gpu, exc)
        if stop.wait(interval_s):
            return
