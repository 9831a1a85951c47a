"""The quality gate while the job runs: every batch beat seals is sampled as it is sealed (its
rows are parsed there anyway: no second read of the stream), a rolling window of their gate
facts is kept in Redis, and the window's figures, alerts included, are stored for progress.py's
snapshot to read with one GET (`quality` in progress.json and `manage.py status --json`). A run
that produces near-empty responses shows it at its first batch (at most DFLASH_BATCH_MAX_AGE_S
after its first row), not after 27 hours.

Cost per batch sealed: one GET, one LPUSH+LTRIM of the batch's newest WINDOW facts, one LRANGE
of the window (WINDOW small JSON lists); nothing in a tick that seals nothing. The loss-token
count of a row is its response length (the server's response ids, else `completion_tokens`): no
tokenizer is needed.

Redis keys (per job, beside the ledger's): `dflash:{job}:quality:cursor` (string: the newest
stream id sampled; rows at or below it are not sampled again), `dflash:{job}:quality:window`
(list of `[loss, length, status, thinking, flags]`, newest first), `dflash:{job}:quality:sampled`
(string: rows sampled so far), `dflash:{job}:quality:alerts` (string: the last alerts, to log a
change once), `dflash:{job}:quality:figures` (string: the figures, JSON).
"""
from __future__ import annotations

import json
import logging

from dflash_tasks.core.conversation import reply_rows
from dflash_tasks.core.keys import JobName
from dflash_tasks.training.data.gate import Report, RowCheck, Rules, Thresholds, text_flags
from dflash_tasks.training.data.tokens import row_thinking

log = logging.getLogger(__name__)

WINDOW = 1000
RULES = Rules()
THRESHOLDS = Thresholds()


def _keys(job: JobName) -> tuple[str, str, str, str]:
    return tuple(job.quality(part) for part in ("cursor", "window", "sampled", "alerts"))


def _figures_key(job: JobName) -> str:
    return job.quality("figures")


def restart_window(r, job: JobName) -> None:
    """Empty the window (a regenerate superseded some of its rows: their facts would still count,
    e.g. truncated rows already generated again); only rows made since are sampled, in the
    batches sealed from now on: the cursor moves past the rows waiting now (one row read, once)."""
    cursor_key, window_key, _, _ = _keys(job)
    newest = r.xrevrange(job.output, count=1)
    pipe = r.pipeline()
    pipe.delete(window_key, _figures_key(job))
    if newest:
        pipe.set(cursor_key, newest[0][0])
    pipe.execute()


def _stream_id(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def row_fact(row: dict, rules: Rules = RULES) -> list:
    """[loss tokens, input length, status, thinking, flags] of one row, without a tokenizer."""
    meta = row.get("metadata") or {}
    ids = row.get("token_ids") or {}
    if ids.get("response") is not None and ids.get("prompt") is not None:
        loss, length = len(ids["response"]), len(ids["prompt"]) + len(ids["response"])
    else:
        loss = int(meta.get("completion_tokens") or 0)
        length = int(meta.get("prompt_tokens") or 0) + loss
    flags = text_flags(row)
    trained = loss  # a long row cut to max_length trains on the loss tokens the cut keeps
    over = rules.max_length is not None and length > rules.max_length
    if over and rules.long_rows == "cut":
        trained = max(0, loss - (length - rules.max_length))
    if trained < rules.min_loss_tokens:
        flags.add("short")
    if over:
        flags.add("over_length")
    return [loss, length, row.get("status"), int(row_thinking(row)), sorted(flags)]


def window_report(facts: list[list], rules: Rules = RULES) -> Report:
    report = Report(rules)
    for loss, length, status, thinking, flags in facts:
        report.add(RowCheck("", str(status), bool(thinking), loss, length, set(flags)))
    return report


def figures(report: Report, sampled: int, thresholds: Thresholds = THRESHOLDS) -> dict:
    f = report.figures()
    lt = f["loss_tokens"]
    alerts = thresholds.failures(report) if report.rows else []
    return {
        "sampled_rows": sampled,
        "window_rows": report.rows,
        "loss_tokens_p10": lt["p10"],
        "loss_tokens_p50": lt["p50"],
        "most_common_loss_tokens": lt["most_common"],
        "most_common_pct": lt["most_common_pct"],
        "short_pct": f["short_pct"],
        "empty_answer_pct": f["empty_answer_pct"],
        "empty_reasoning_pct": f["empty_reasoning_pct"],
        "think_marker_rows": f["marker_in_content"] + f["marker_in_reasoning"],
        "truncated_pct": f["truncated_pct"],
        "over_length_pct": f["over_length_pct"],
        "min_loss_tokens": report.rules.min_loss_tokens,
        "ok": not alerts,
        "alerts": alerts,
    }


def sample_quality(r, job: JobName, entries: list[tuple[str, dict]], *,
                   window: int = WINDOW) -> dict:
    """Sample a sealed batch, given as its (stream id, row) pairs oldest first (BatchWriter's
    on_sealed): its rows past the cursor join the window, the window's figures are stored for
    the snapshot and returned (an `error` entry instead when anything fails: sealing goes on)."""
    try:
        cursor_key, window_key, sampled_key, alerts_key = _keys(job)
        cursor = r.get(cursor_key)
        floor = _stream_id(cursor.decode()) if cursor else (0, 0)
        fresh = [(i, row) for i, row in entries if _stream_id(i) > floor][-window:]
        pipe = r.pipeline()
        if fresh:
            # Pushed oldest first: the newest on top.
            # A conversation's replies, each a training row of its own (reply_rows).
            pipe.lpush(window_key, *(json.dumps(row_fact(view)) for _, row in fresh
                                     for view in reply_rows(row)))
            pipe.ltrim(window_key, 0, window - 1)
            pipe.set(cursor_key, fresh[-1][0])
            pipe.incrby(sampled_key, len(fresh))
        pipe.lrange(window_key, 0, -1)
        pipe.get(sampled_key)
        *_, raw, sampled = pipe.execute()
        out = figures(window_report([json.loads(x) for x in raw]), int(sampled or 0))
        text = json.dumps(out["alerts"])
        if (r.getset(alerts_key, text) or b"[]").decode() != text and out["alerts"]:
            log.warning("job %s: training-data quality of the last %d rows sampled: %s", job,
                        out["window_rows"], "; ".join(out["alerts"]))
    except Exception as exc:  # never let the quality sample stop sealing
        log.exception("job %s: quality sample failed", job)
        out = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    try:
        r.set(_figures_key(job), json.dumps(out))
    except Exception:
        log.exception("job %s: storing the quality figures failed", job)
    return out
