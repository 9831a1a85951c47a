"""Read a prompt dataset as a stream of normalised conversations, one row at a time.

Files
    JSON Lines: ``.jsonl`` / ``.json`` (one JSON object per line), optionally compressed as
    ``.jsonl.gz`` / ``.json.gz`` or ``.jsonl.zst`` / ``.json.zst``; ``Prompt.line`` is the
    1-based physical line, and blank lines are skipped.  Parquet: ``.parquet``, read in record
    batches; ``Prompt.line`` is the 1-based row number.  Nothing reads the whole file at once.

Datasets by name
    ``hf:ORG/NAME`` (streamed from the Hugging Face hub), a directory written by
    ``save_to_disk``, or a directory in the hub's own layout, with a subset and a split
    (train by default): read through the ``datasets`` library (hub.py), rows numbered as
    Parquet's, the same normalisation and ids as a file's.

Rows
    The first non-null of these fields is used:

    * ``conversations`` or ``messages``: a list of turns, each ``{"role", "content"}`` or
      ShareGPT ``{"from", "value"}``.  Roles: human/user -> user; gpt/assistant/model/chatgpt/
      bing -> assistant; system -> system; tool/function/observation -> tool (case-insensitive);
      any other role is an error.  Content is a string, or a list of ``{"type": "text", "text"}``
      parts joined with "\\n"; anything else is an error.
    * ``prompt``: a string, which becomes one user turn, preceded by a system turn when a
      non-empty ``system`` string sits beside it.

    Trailing assistant turns are dropped (the model regenerates them; their content is not
    checked).  What remains must be non-empty and end with a user or tool turn whose content is
    not blank.  Turns keep only ``role`` and ``content``; other fields of the row are ignored.
    A JSONL line that is not valid UTF-8, or whose escapes decode to an unpaired surrogate, is a
    bad row too.

Ids
    ``id`` (string or integer; integers become their decimal string) when present and non-null.
    Otherwise the id is derived from the normalised messages (after trailing assistant turns are
    dropped)::

        "h" + blake2b(json.dumps(messages, sort_keys=True, separators=(",", ":"),
                                 ensure_ascii=False).encode("utf-8"), digest_size=12).hexdigest()

    so it is stable across runs and machines, and equivalent spellings of one conversation
    (human/gpt vs user/assistant, prompt vs a single user turn, with or without the trailing
    answer) get the same id.  ``content_id(messages)`` computes it.  ``read_prompts`` yields a
    given id once per read, so rows with identical content and no id are deduplicated.

Samples
    With ``samples`` > 1 (``enqueue --samples N``) a prompt is N prompts, each its own row, its id
    the prompt's followed by ``#`` and the sample's index (``q17#0`` .. ``q17#3``):
    ``with_samples``, ``sample_id`` and ``prompt_of``.

Errors
    A malformed row becomes a ``BadRow`` whose reason names it ("line 17: unknown role
    'narrator' in turn 3"; Parquet rows say "row 17: ...").  ``DatasetError`` is raised when the
    call is made for a missing file or an unsupported extension, and during iteration for a file
    that cannot be read at all (corrupt compression or Parquet, no usable Parquet column).
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import zlib
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import zstandard

from dflash_tasks.core import conversation
from dflash_tasks.ingest import hub

ROLES = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant",
    "chatgpt": "assistant", "bing": "assistant",
    "system": "system",
    "tool": "tool", "function": "tool", "observation": "tool",
}
JSONL_SUFFIXES = {  # suffix -> compression
    ".jsonl": None, ".json": None,
    ".jsonl.gz": "gzip", ".json.gz": "gzip",
    ".jsonl.zst": "zstd", ".json.zst": "zstd",
}
PARQUET_SUFFIX = ".parquet"
# The columns a Parquet file's or a named dataset's row is read from (the others are never
# decoded), and those of them a row's messages come from
ROW_COLUMNS = ("id", "conversations", "messages", "prompt", "system")
MESSAGE_COLUMNS = ("conversations", "messages", "prompt")
PARQUET_BATCH_ROWS = 4096
NAMED_DUPLICATES = 20  # duplicate rows a read names (all are counted)


class DatasetError(ValueError):
    """The dataset file as a whole cannot be read."""


class _RowError(Exception):
    """One row is malformed; the message becomes a BadRow reason."""


@dataclass(frozen=True, slots=True)
class Prompt:
    id: str
    messages: tuple[dict, ...]  # each {"role": ..., "content": ...}, normalised
    line: int  # 1-based line (JSONL) or row number (Parquet)


@dataclass(frozen=True, slots=True)
class BadRow:
    line: int
    reason: str  # e.g. "line 4: not valid JSON (Expecting ',' delimiter at column 18)"


@dataclass
class ReadSummary:
    rows: int = 0  # non-blank rows read: valid + len(bad)
    valid: int = 0  # well-formed rows, duplicates included
    bad: list[BadRow] = field(default_factory=list)
    duplicates: int = 0  # valid rows whose id was already seen in this read (not yielded)
    # The first of them, named: (line, id, the line that kept it); lines are rows in Parquet
    # and a dataset by name (`unit`)
    duplicate_rows: list[tuple[int, str, int]] = field(default_factory=list)
    unit: str = "line"


def iter_rows(path: str | Path, *, subset: str | None = None, split: str | None = None,
              every_turn: bool = False) -> Iterator[Prompt | BadRow]:
    """Every non-blank row of the dataset at `path` (a file, or a dataset by name: hub.py, with
    its `subset` and `split`), in order, as a Prompt or a BadRow; `every_turn`: as a script
    whose every assistant reply is regenerated (core/conversation.py)."""
    return _parsed(*_records(path, subset, split), every_turn)


def _records(path: str | Path, subset: str | None,
             split: str | None) -> tuple[Iterator[tuple[int, Any]], str]:
    """The dataset's lazy records, checked now, and the unit ("line"/"row") they count in."""
    if hub.is_named(path):
        return _named_records(path, subset, split), "row"
    if subset is not None or split is not None:
        raise DatasetError(f"{path}: --subset and --split are for a dataset by name (hf:ORG/NAME)"
                           " or a dataset directory, not a file")
    return _open_records(Path(path))


def _parsed(records: Iterator[tuple[int, Any]], unit: str,
            every_turn: bool) -> Iterator[Prompt | BadRow]:
    return (_parse_record(number, raw, unit, every_turn) for number, raw in records)


def read_prompts(path: str | Path, limit: int | None = None,
                 summary: ReadSummary | None = None, *, subset: str | None = None,
                 split: str | None = None, every_turn: bool = False) -> Iterator[Prompt]:
    """Valid prompts with ids not seen before in this read, at most `limit` of them.

    Bad rows and duplicates are counted in `summary` (filled in as the iterator is consumed)
    instead of raising; reading stops as soon as the limit is reached.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    records, unit = _records(path, subset, split)
    summary = summary if summary is not None else ReadSummary()
    summary.unit = unit
    return _unique_prompts(_parsed(records, unit, every_turn), limit, summary)


def _unique_prompts(rows: Iterator[Prompt | BadRow], limit: int | None,
                    summary: ReadSummary) -> Iterator[Prompt]:
    # A dict of strings, not a set: the collector never traverses it (CPython untracks a dict
    # holding only atomic values), where every full collection walked a set of every id read
    # so far, which made reading ten million rows quadratic (bench case 9: 150 s to 73 s).
    seen: dict[str, int] = {}  # id -> the line that gave it
    with closing(rows):
        if limit == 0:
            return
        for row in rows:
            summary.rows += 1
            if isinstance(row, BadRow):
                summary.bad.append(row)
                continue
            summary.valid += 1
            if row.id in seen:
                summary.duplicates += 1
                if len(summary.duplicate_rows) < NAMED_DUPLICATES:
                    summary.duplicate_rows.append((row.line, row.id, seen[row.id]))
                continue
            seen[row.id] = row.line
            yield row
            if len(seen) == limit:
                return


# --- files -> (number, raw record) ---------------------------------------------------------

def _named_records(source: str | Path, subset: str | None,
                   split: str | None) -> Iterator[tuple[int, dict]]:
    """hub.records, its errors as DatasetError: opened now, read lazily."""
    try:
        records = hub.records(source, subset, split, columns=ROW_COLUMNS,
                              required=MESSAGE_COLUMNS)
    except hub.HubError as exc:
        raise DatasetError(str(exc)) from None

    def read() -> Iterator[tuple[int, dict]]:
        try:
            yield from records
        except hub.HubError as exc:
            raise DatasetError(str(exc)) from None

    return read()


def _open_records(path: Path) -> tuple[Iterator[tuple[int, Any]], str]:
    """Check the path now; return the lazy records and the unit ("line"/"row") they count in."""
    name = path.name.lower()
    is_parquet = name.endswith(PARQUET_SUFFIX)
    jsonl_suffix = next((suffix for suffix in JSONL_SUFFIXES if name.endswith(suffix)), None)
    if jsonl_suffix is None and not is_parquet:
        known = ", ".join([*JSONL_SUFFIXES, PARQUET_SUFFIX])
        raise DatasetError(f"{path}: unsupported dataset file type (expected {known})")
    if not path.exists():
        raise DatasetError(f"{path}: no such file")
    if not path.is_file():
        raise DatasetError(f"{path}: not a regular file")
    if is_parquet:
        return _parquet_records(path), "row"
    return _jsonl_records(path, JSONL_SUFFIXES[jsonl_suffix]), "line"


def _open_binary(path: Path, compression: str | None) -> io.BufferedIOBase:
    if compression == "gzip":
        return gzip.open(path, "rb")
    if compression == "zstd":
        reader = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True)
        return io.BufferedReader(reader, buffer_size=1 << 20)
    return open(path, "rb", buffering=1 << 20)


def _jsonl_records(path: Path, compression: str | None) -> Iterator[tuple[int, bytes]]:
    number = 0
    try:
        with _open_binary(path, compression) as lines:
            for number, line in enumerate(lines, 1):
                if not line.isspace():
                    yield number, line
    except (OSError, EOFError, zlib.error, zstandard.ZstdError) as exc:
        raise DatasetError(f"{path}: cannot read past line {number}: {exc}") from exc


def _parquet_records(path: Path) -> Iterator[tuple[int, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    number = 0
    try:
        with pq.ParquetFile(path) as table:
            columns = [c for c in ROW_COLUMNS if c in table.schema_arrow.names]
            if not set(columns) & set(MESSAGE_COLUMNS):
                raise DatasetError(f"{path}: no 'conversations', 'messages' or 'prompt' column")
            for batch in table.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
                for row in batch.to_pylist():
                    number += 1
                    yield number, row
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{path}: cannot read Parquet past row {number}: {exc}") from exc


# --- raw record -> Prompt ------------------------------------------------------------------

def _parse_record(number: int, raw: bytes | dict, unit: str, every_turn: bool) -> Prompt | BadRow:
    try:
        row = _json_object(raw) if isinstance(raw, bytes) else raw
        messages = _row_messages(row, every_turn)
        return Prompt(id=_row_id(row, messages), messages=tuple(messages), line=number)
    except _RowError as exc:
        return BadRow(line=number, reason=f"{unit} {number}: {exc}")


def _json_object(line: bytes) -> dict:
    """The line's JSON object. orjson first (three times the stdlib's speed, and strict: it takes
    only valid UTF-8 without lone surrogates, so what it accepts needs no further check); what it
    refuses goes through the stdlib, whose verdict and messages decide (it also takes a BOM, NaN
    and integers past 64 bits, which orjson refuses or would turn into floats)."""
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError:
        return _json_object_stdlib(line)
    if not isinstance(value, dict) or isinstance(value.get("id"), float):
        return _json_object_stdlib(line)  # the stdlib's message, or an id orjson made a float
    return value


def _json_object_stdlib(line: bytes) -> dict:
    try:
        text = line.decode("utf-8")  # strict: UTF-8-encoded surrogates are invalid too
    except UnicodeDecodeError as exc:
        raise _RowError(f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        value = json.loads(text[1:] if text[:1] == "\ufeff" else text)  # a BOM on line 1
    except json.JSONDecodeError as exc:
        # json messages may end in "at" already ("Invalid control character at")
        raise _RowError(f"not valid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})") from None
    if not isinstance(value, dict):
        raise _RowError(f"not a JSON object (got {_kind(value)})")
    if (b"\\ud" in line or b"\\uD" in line) and not _encodable(value):
        raise _RowError("contains an unpaired surrogate escape (invalid Unicode)")
    return value


def _encodable(value: dict) -> bool:
    """False when a \\uD800-\\uDFFF escape decoded to a lone surrogate, which cannot be encoded
    and would break tokenizers and writers later.  Only JSON escapes can produce one, so callers
    check only rows whose line contains such an escape (Parquet strings are always valid UTF-8)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _row_messages(row: dict, every_turn: bool = False) -> list[dict]:
    for name in ("conversations", "messages"):
        if row.get(name) is not None:
            messages = _conversation(row[name], name, every_turn)
            return _script(messages) if every_turn else messages
    if row.get("prompt") is not None:
        return _prompt_messages(row["prompt"], row.get("system"))
    raise _RowError("no 'conversations', 'messages' or 'prompt' field")


def _prompt_messages(prompt: Any, system: Any) -> list[dict]:
    prompt = _text(prompt, "'prompt'")
    if not prompt or prompt.isspace():  # blank (as strip() would say, without a copy)
        raise _RowError("'prompt' is empty")
    system = "" if system is None else _text(system, "'system'")
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": prompt}]


def _script(messages: list[dict]) -> list[dict]:
    """The conversation as a script (core/conversation.py): each run of assistant turns after
    the first user turn one slot, its dataset text dropped."""
    out: list[dict] = []
    for m in messages:
        if conversation.is_slot(m):
            if not conversation.is_slot(out[-1]):
                out.append(dict(conversation.SLOT))
            continue
        out.append(m)
    return out


def _conversation(turns: Any, name: str, every_turn: bool = False) -> list[dict]:
    if not isinstance(turns, list):
        raise _RowError(f"'{name}' is {_kind(turns)}, not a list of turns")
    if not turns:
        raise _RowError("conversation is empty")
    roles = [_role(turn, i) for i, turn in enumerate(turns, 1)]
    end = len(roles)
    while end and roles[end - 1] == "assistant":
        end -= 1
    if not end:
        raise _RowError("no user turn to answer (only assistant turns)")
    if roles[end - 1] not in ("user", "tool"):
        raise _RowError(f"no user turn to answer (conversation ends with a {roles[end - 1]} turn)")
    # Replies the target regenerates (every_turn: those after the first user turn) are slots:
    # their text is not read.
    asked = roles.index("user") + 1 if "user" in roles else end
    messages = [{"role": role, "content": None if every_turn and role == "assistant" and i > asked
                 else _content(turn, i)}
                for i, (role, turn) in enumerate(zip(roles[:end], turns), 1)]
    if not messages[-1]["content"] or messages[-1]["content"].isspace():
        raise _RowError(f"turn {end}, the one to answer, is empty")
    return messages


def _role(turn: Any, i: int) -> str:
    if not isinstance(turn, dict):
        raise _RowError(f"turn {i} is {_kind(turn)}, not an object")
    name = turn.get("role") if turn.get("role") is not None else turn.get("from")
    if name is None:
        raise _RowError(f"turn {i} has no 'role' or 'from'")
    role = ROLES.get(name.lower()) if isinstance(name, str) else None
    if role is None:
        raise _RowError(f"unknown role {name!r} in turn {i}")
    return role


def _content(turn: dict, i: int) -> str:
    content = turn.get("content") if turn.get("content") is not None else turn.get("value")
    if content is None:
        raise _RowError(f"turn {i} has no content")
    if isinstance(content, list):
        return "\n".join(_text_part(part, i) for part in content)
    return _text(content, f"content of turn {i}")


def _text_part(part: Any, i: int) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = repr(part.get("type")) if isinstance(part, dict) else _kind(part)
        raise _RowError(f"content of turn {i} has a non-text part ({kind})")
    return _text(part.get("text"), f"a text part of turn {i}")


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _RowError(f"{what} is {_kind(value)}, not a string")
    return value


def _row_id(row: dict, messages: list[dict]) -> str:
    value = row.get("id")
    if value is None:
        return content_id(messages)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise _RowError(f"'id' is {_kind(value)}, not a string or integer")
    if value == "":
        raise _RowError("'id' is empty")
    return str(value)


def sample_id(prompt_id: str, sample: int, samples: int) -> str:
    """The id of a prompt's sample: the prompt's own when it has one, else "<id>#<sample>"."""
    return prompt_id if samples == 1 else f"{prompt_id}#{sample}"


def prompt_of(row_id: str, samples: int) -> str:
    """The prompt a row's id is a sample of (sample_id's inverse)."""
    return row_id if samples == 1 else row_id.rpartition("#")[0]


def with_samples(prompts: Iterator[Prompt], samples: int) -> Iterator[Prompt]:
    """Each prompt as its `samples` samples, in order, sharing its messages."""
    if samples == 1:
        yield from prompts
        return
    for p in prompts:
        for k in range(samples):
            yield Prompt(id=sample_id(p.id, k, samples), messages=p.messages, line=p.line)


def content_id(messages: list[dict] | tuple[dict, ...]) -> str:
    """The id of a row without one: a hash of its normalised messages (see module docstring)."""
    canonical = json.dumps(list(messages), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "h" + hashlib.blake2b(canonical.encode("utf-8"), digest_size=12).hexdigest()


def question_id(messages: list[dict] | tuple[dict, ...]) -> str:
    """What makes two prompts one question: content_id of their turns other than the
    assistant's (a row's assistant turns were generated, a dataset's are dropped or replaced), by
    role and content alone. Held-out prompts are checked against a job's rows with it."""
    return content_id([{"role": m.get("role"), "content": m.get("content")} for m in messages
                       if m.get("role") != "assistant"])


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "a list", dict: "an object"}.get(type(value), type(value).__name__)
