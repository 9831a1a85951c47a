"""The quality gate while the job runs: each beat tick samples the freshest rows of the job's
output stream (before they are sealed), keeps a rolling window of their gate facts in Redis,
and stores the window's figures, alerts included, which progress.py's snapshot reads with one GET
(`quality` in progress.json and `manage.py status --json`). A run that
produces near-empty responses shows it within its first ticks, not after 27 hours.

Cost per tick: one GET, one XREVRANGE of at most PER_TICK rows newer than the last one sampled
(rows arriving faster than that are sampled, not all read), one LPUSH+LTRIM, one LRANGE of the
window (WINDOW small JSON lists). The loss-token count of a row is its response length (the
server's response ids, else `completion_tokens`): no tokenizer is needed.

Redis keys (per job, beside the ledger's): `dflash:{job}:quality:cursor` (string: the newest
stream id sampled), `dflash:{job}:quality:window` (list of `[loss, length, status, thinking,
flags]`, newest first), `dflash:{job}:quality:sampled` (string: rows sampled so far),
`dflash:{job}:quality:alerts` (string: the last alerts, to log a change once),
`dflash:{job}:quality:figures` (string: the figures, JSON).
"""
from __future__ import annotations

import json
import logging

from dflash_tasks.core.keys import JobKeys
from dflash_tasks.training.data.gate import Report, RowCheck, Rules, Thresholds, text_flags
from dflash_tasks.training.data.tokens import row_thinking

log = logging.getLogger(__name__)

PER_TICK = 200
WINDOW = 1000
RULES = Rules()
THRESHOLDS = Thresholds()


def _keys(job: str) -> tuple[str, str, str, str]:
    k = JobKeys(job)
    return k.quality("cursor"), k.quality("window"), k.quality("sampled"), k.quality("alerts")


def _figures_key(job: str) -> str:
    return JobKeys(job).quality("figures")


def restart_window(r, job: str) -> None:
    """Empty the window (a regenerate superseded some of its rows: their facts would still count,
    e.g. truncated rows already generated again); the next ticks fill it with rows made since."""
    _, window_key, _, _ = _keys(job)
    r.delete(window_key, _figures_key(job))


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
    if loss < rules.min_loss_tokens:
        flags.add("short")
    if length > rules.max_length:
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


def sample_quality(r, job: str, *, per_tick: int = PER_TICK, window: int = WINDOW) -> dict:
    """Sample the rows that arrived since the last tick, store the window's figures for the
    snapshot and return them (an `error` entry instead when anything fails: the tick itself
    must go on)."""
    try:
        cursor_key, window_key, sampled_key, alerts_key = _keys(job)
        cursor = r.get(cursor_key)
        low = f"({cursor.decode()}" if cursor else "-"
        entries = r.xrevrange(JobKeys(job).output, max="+", min=low, count=per_tick)
        if entries:
            facts = [json.dumps(row_fact(json.loads(fields[b"row"])))
                     for _, fields in reversed(entries)]  # pushed oldest first: newest on top
            pipe = r.pipeline()
            pipe.lpush(window_key, *facts)
            pipe.ltrim(window_key, 0, window - 1)
            pipe.set(cursor_key, entries[0][0])
            pipe.incrby(sampled_key, len(entries))
            pipe.execute()
        raw, sampled = r.lrange(window_key, 0, -1), int(r.get(sampled_key) or 0)
        out = figures(window_report([json.loads(x) for x in raw]), sampled)
        text = json.dumps(out["alerts"])
        if (r.getset(alerts_key, text) or b"[]").decode() != text and out["alerts"]:
            log.warning("job %s: training-data quality of the last %d rows sampled: %s", job,
                        out["window_rows"], "; ".join(out["alerts"]))
    except Exception as exc:  # never let the quality sample stop progress.json
        log.exception("job %s: quality sample failed", job)
        out = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    try:
        r.set(_figures_key(job), json.dumps(out))
    except Exception:
        log.exception("job %s: storing the quality figures failed", job)
    return out
