"""Validate a job's rows against the quality gate, and export the rows that pass it in the forms
training reads:

- `specforge-conversations`: SpecForge's regenerated-data JSONL, one `{"id", "conversations",
  "status"}` per line (the assistant turn keeps `content` and `reasoning_content` apart), for
  its raw-conversation data path (SpecForge renders it with its own template, which must be
  the rows' thinking mode's: training/queue/specforge.py; the differences that remain are in
  docs/TRAINING_DATA.md);
- `specforge-tokenized`: one `{"id", "input_ids", "loss_mask"}` per line, for SpecForge's
  pre-tokenized `prompts_path` (no template involved at training time);
- `parquet`: one file with `id`, `conversations`, `status`, `input_ids`, `loss_mask` and the
  generation metadata, for `datasets.load_dataset("parquet", ...)`.

A conversation whose every reply was generated (`enqueue --turns all`) is one training row per
reply, ending at it, in its own context (core/conversation.py).

Every format writes, beside its data file, `<stem>.export_report.json` (rows read, kept, dropped
per reason, the gate's figures) and `<stem>.dropped.jsonl` (`{"id", "reason"}` per dropped row),
named after its data file so that several formats exported to one directory keep their own
(`tokenized.export_report.json` beside `tokenized.jsonl`). Files are written under a temporary
name and renamed when complete. Rows come newest batch first (the newest copy of each id wins;
see reader.py).
"""
from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator

from dflash_tasks.core.conversation import reply_rows
from dflash_tasks.output.storage import Storage
from dflash_tasks.training.data.gate import REASONS, HeldOut, Report, Rules, Thresholds, check_row
from dflash_tasks.training.data.reader import NewestRows, job_storage, manifest_records
from dflash_tasks.training.data.tokens import (
    ChatTemplate,
    Tokenized,
    TokenizeError,
    compare,
    from_server_ids,
    row_thinking,
    tokenize_row,
)

FORMATS = ("specforge-conversations", "specforge-tokenized", "parquet")
FILES = {"specforge-conversations": "conversations.jsonl",
         "specforge-tokenized": "tokenized.jsonl",
         "parquet": "train.parquet"}


def report_files(fmt: str) -> tuple[str, str]:
    """(export report, dropped ids) file names of format `fmt`, beside its data file."""
    stem = FILES[fmt].split(".")[0]
    return f"{stem}.export_report.json", f"{stem}.dropped.jsonl"


@dataclass
class Checked:
    row: dict
    tok: Tokenized | None
    reason: str | None  # why it is dropped; None when kept


def checked_rows(storage: Storage, job: str, report: Report, *, template: ChatTemplate | None = None,
                 compare_rows: int = 1000, limit: int | None = None,
                 on_batch: Callable[[dict], None] | None = None,
                 on_duplicate: Callable[[dict], None] | None = None,
                 records: list[dict] | None = None) -> Iterator[Checked]:
    """Every newest row of the job, tokenized (server ids first), checked and counted in
    `report`. With a template, up to `compare_rows` rows that have server ids are also rendered
    through the template, and disagreements counted (report.prompt_mismatch)."""

    def duplicate(row: dict) -> None:
        report.add_duplicate()
        if on_duplicate:
            on_duplicate(row)

    batch: list[str | None] = [None]  # the batch being read, named where modes conflict

    def reading(rec: dict) -> None:
        batch[0] = rec.get("name")
        if on_batch:
            on_batch(rec)

    for row in (view for newest in NewestRows(storage, job, records=records, on_batch=reading,
                                              on_duplicate=duplicate, limit=limit)
                for view in reply_rows(newest)):
        try:
            tok = tokenize_row(row, template)
        except TokenizeError as exc:
            tok = None
            if template is not None and len(report.tokenize_errors) < 5:
                report.tokenize_errors.append(str(exc))
        if template is not None and report.compared < compare_rows and from_server_ids(row):
            try:
                agreement = compare(row, template)
            except TokenizeError as exc:
                agreement = None
                report.tokenize_errors.append(str(exc))
            if agreement is not None:
                report.compared += 1
                report.prompt_mismatch += not agreement.prompt_equal
                report.response_mismatch += not (agreement.tokens_equal and agreement.mask_equal)
                if not (agreement.prompt_equal and agreement.tokens_equal) \
                        and len(report.mismatch_examples) < 5:
                    report.mismatch_examples.append(row.get("id"))
        check = check_row(row, tok, report.rules)
        reason = report.add(check, tok)
        if reason is None:  # one mode among the rows trained on; a dropped row teaches nothing
            report.modes.add(row, batch[0])
        yield Checked(row, report.rules.trained(tok), reason)  # a long row cut, as trained


def validate_job(storage: Storage, job: str, rules: Rules, thresholds: Thresholds, *,
                 template: ChatTemplate | None = None, sample: int | None = None,
                 compare_rows: int = 1000, heldout: Iterable = (),
                 on_batch: Callable[[dict], None] | None = None) -> tuple[Report, list[str]]:
    """The gate over the job's shipped rows (the newest `sample` rows, when given). `heldout`:
    an evaluation's prompts (ingest Prompt), each a failure when it is one of the rows'."""
    report = Report(rules, heldout=HeldOut(heldout))
    for item in checked_rows(storage, job, report, template=template, compare_rows=compare_rows,
                             limit=sample, on_batch=on_batch):
        report.heldout.see(item.row)
    return report, thresholds.failures(report)


# -- export ----------------------------------------------------------------------------------------


@dataclass
class TrainingExport:
    job: str
    fmt: str
    path: Path
    report: Report
    kept: int = 0
    files: list[str] = field(default_factory=list)
    # Kept rows per thinking mode: a conversations file is rendered with one mode's template.
    thinking: Counter = field(default_factory=Counter)

    def summary(self) -> dict:
        dropped = dict(self.report.dropped)
        return {"job": self.job, "format": self.fmt, "path": str(self.path),
                "rows_read": self.report.rows + self.report.duplicates, "unique_ids": self.report.rows,
                "kept": self.kept, "dropped": dropped,
                "thinking_modes": {"thinking": self.thinking[True],
                                   "non_thinking": self.thinking[False]},
                "dropped_reasons": {k: REASONS[k] for k in dropped},
                "figures": self.report.figures()}


def _conversation_record(row: dict) -> dict:
    return {"id": row["id"], "conversations": row["conversations"], "status": row["status"]}


def _text(content) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return json.dumps(content, ensure_ascii=False)  # OpenAI-style parts: kept, as JSON


class _ParquetWriter:
    ROW_GROUP = 1000

    def __init__(self, path: Path):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.pa, self.pq = pa, pq
        turn = pa.struct([("role", pa.string()), ("content", pa.string()),
                          ("reasoning_content", pa.string())])
        self.schema = pa.schema([
            ("id", pa.string()), ("conversations", pa.list_(turn)), ("status", pa.string()),
            ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
            ("loss_tokens", pa.int32()), ("finish_reason", pa.string()),
            ("enable_thinking", pa.bool_()), ("prompt_tokens", pa.int32()),
            ("completion_tokens", pa.int32()), ("model", pa.string()), ("metadata", pa.string())])
        self.writer = pq.ParquetWriter(str(path), self.schema, compression="zstd")
        self.buffer: list[dict] = []

    def write(self, row: dict, tok: Tokenized | None) -> None:
        meta = row.get("metadata") or {}
        self.buffer.append({
            "id": str(row["id"]),
            "conversations": [{"role": t.get("role"), "content": _text(t.get("content")),
                               "reasoning_content": _text(t.get("reasoning_content"))}
                              for t in row["conversations"]],
            "status": row.get("status"),
            "input_ids": tok.input_ids if tok else None,
            "loss_mask": tok.loss_mask if tok else None,
            "loss_tokens": tok.loss_tokens if tok else None,
            "finish_reason": meta.get("finish_reason"),
            "enable_thinking": meta.get("enable_thinking"),
            "prompt_tokens": meta.get("prompt_tokens"),
            "completion_tokens": meta.get("completion_tokens"),
            "model": meta.get("model"),
            "metadata": json.dumps(meta, sort_keys=True)})
        if len(self.buffer) >= self.ROW_GROUP:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            self.writer.write_table(self.pa.Table.from_pylist(self.buffer, schema=self.schema))
            self.buffer = []

    def close(self) -> None:
        self.flush()
        self.writer.close()


def export_training(storage: Storage, job: str, fmt: str, dest: Path, rules: Rules, *,
                    template: ChatTemplate | None = None,
                    on_batch: Callable[[dict], None] | None = None) -> TrainingExport:
    """Write the rows that pass `rules` in format `fmt` into directory `dest`."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: one of {', '.join(FORMATS)}")
    if fmt == "specforge-conversations":
        rules = replace(rules, require_tokens=False)  # SpecForge tokenizes these itself
    storage = job_storage(storage, job)
    records = manifest_records(storage, job)  # a bad manifest is refused before dest exists
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    report = Report(rules)
    path = dest / FILES[fmt]
    tmp = dest / f".{path.name}.partial"
    report_name, dropped_name = report_files(fmt)
    dropped_tmp = dest / f".{dropped_name}.partial"
    out = TrainingExport(job, fmt, path, report)
    parquet = _ParquetWriter(tmp) if fmt == "parquet" else None
    try:
        with open(dropped_tmp, "w") as dropped_f, \
                (open(tmp, "w") if parquet is None else open(os.devnull, "w")) as data_f:
            def on_duplicate(row: dict) -> None:
                dropped_f.write(json.dumps({"id": row.get("id"), "reason": "duplicate"}) + "\n")

            for item in checked_rows(storage, job, report, template=template, on_batch=on_batch,
                                     on_duplicate=on_duplicate, compare_rows=0, records=records):
                if item.reason:
                    dropped_f.write(json.dumps({"id": item.row.get("id"), "reason": item.reason}) + "\n")
                    continue
                out.kept += 1
                out.thinking[row_thinking(item.row)] += 1
                if fmt == "specforge-conversations":
                    data_f.write(json.dumps(_conversation_record(item.row), ensure_ascii=False) + "\n")
                elif fmt == "specforge-tokenized":
                    data_f.write(json.dumps({"id": item.row["id"], "input_ids": item.tok.input_ids,
                                             "loss_mask": item.tok.loss_mask}) + "\n")
                else:
                    parquet.write(item.row, item.tok)
        if parquet is not None:
            parquet.close()
            parquet = None
        os.replace(tmp, path)
        os.replace(dropped_tmp, dest / dropped_name)
    finally:
        if parquet is not None:
            parquet.writer.close()
        for leftover in (tmp, dropped_tmp):
            leftover.unlink(missing_ok=True)
    out.files = [path.name, dropped_name, report_name]
    report_tmp = dest / f".{report_name}.partial"
    report_tmp.write_text(json.dumps(out.summary(), indent=1))
    os.replace(report_tmp, dest / report_name)
    return out
