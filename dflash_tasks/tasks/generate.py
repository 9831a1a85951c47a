"""The prompt task: one prompt, one SGLang request, one ledger entry, then refill the window."""
from __future__ import annotations

import logging
import random
import threading
import time

from ..celery_app import app
from ..connections import ledger
from ..dispatch import GENERATE, topup
from ..jobs import GenerationParams
from ..keys import queue_for
from ..rows import build_row
from ..settings import get_settings
from ..sglang import PermanentError, SGLangClient, SGLangError, TransientError
from .. import worker_hooks  # noqa: F401  (registers the worker's start-up signals)

log = logging.getLogger(__name__)
_clients: dict[str, SGLangClient] = {}
_clients_lock = threading.Lock()


def client_for(gpu: int) -> SGLangClient:
    """The worker process's one client for its GPU's server, shared by all its threads."""
    s = get_settings()
    url = s.sglang_url_for(gpu)
    with _clients_lock:
        if url not in _clients:
            _clients[url] = SGLangClient(url, connect_timeout_s=s.connect_timeout_s,
                                         request_timeout_s=s.request_timeout_s,
                                         keepalive_expiry_s=s.keepalive_expiry_s)
        return _clients[url]


def backoff_s(retries: int) -> float:
    """Exponential backoff with full jitter: spreads the retries of many prompts that failed
    together (a server restart) instead of sending them back at once."""
    s = get_settings()
    return random.uniform(0, min(s.retry_cap_s, s.retry_base_s * 2 ** retries))


@app.task(name=GENERATE, bind=True, max_retries=None)
def generate(self, job: str, prompt_id: str, gpu: int) -> dict:
    book = ledger()
    try:
        state = book.task_state(job, prompt_id)
        if state.done:
            book.drop_inflight(job, gpu, prompt_id)
            return {"id": prompt_id, "skipped": "already done"}
        if state.messages is None or state.params is None:
            book.drop_inflight(job, gpu, prompt_id)
            return {"id": prompt_id, "skipped": "not pending (failed or job removed)"}
        params = GenerationParams.from_dict(state.params)
        attempts = self.request.retries + 1
        client = client_for(gpu)
        rid = f"{job}:{prompt_id}:{attempts}"
        try:
            completion = client.chat(state.messages, max_tokens=params.max_tokens,
                                     temperature=params.temperature, top_p=params.top_p,
                                     top_k=params.top_k, enable_thinking=params.enable_thinking,
                                     rid=rid)
        except TransientError as exc:
            if exc.reason == "timeout":
                client.abort(rid)  # or the server keeps decoding for nobody
            if self.request.retries < get_settings().max_retries:
                log.info("prompt %s on gpu%d: %s; retry %d", prompt_id, gpu, exc, attempts)
                raise self.retry(exc=exc, countdown=backoff_s(self.request.retries),
                                 queue=queue_for(gpu))
            return _fail(job, prompt_id, gpu, exc, attempts)
        except PermanentError as exc:
            return _fail(job, prompt_id, gpu, exc, attempts)
        row = build_row(prompt_id, state.messages, completion, job=job, gpu=gpu, params=params,
                        attempts=attempts)
        recorded = book.complete(job, prompt_id, gpu, row)
        return {"id": prompt_id, "finish_reason": completion.finish_reason,
                "completion_tokens": completion.completion_tokens,
                **({} if recorded else {"skipped": "duplicate delivery"})}
    finally:
        topup(app, job, gpu)


def _fail(job: str, prompt_id: str, gpu: int, exc: SGLangError, attempts: int) -> dict:
    record = {"id": prompt_id, "reason": exc.reason, "transient": exc.transient,
              "error": str(exc)[:2000], "status": exc.status, "attempts": attempts, "gpu": gpu,
              "at": time.time()}
    ledger().fail(job, prompt_id, gpu, record)
    log.warning("prompt %s failed on gpu%d after %d attempt(s): %s", prompt_id, gpu, attempts, exc)
    return {"id": prompt_id, "failed": exc.reason}
