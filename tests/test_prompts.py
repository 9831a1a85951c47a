"""Tests for dflash_tasks.ingest.prompts: reading JSONL / Parquet prompt datasets."""
from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from dflash_tasks.ingest.prompts import (
    BadRow,
    DatasetError,
    Prompt,
    ReadSummary,
    content_id,
    iter_rows,
    read_prompts,
)

USER_HI = ({"role": "user", "content": "hi"},)


def write_jsonl(path: Path, rows: list) -> Path:
    """Rows that are strings are written verbatim (for malformed lines); others as JSON."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def only(path: Path) -> Prompt | BadRow:
    rows = list(iter_rows(path))
    assert len(rows) == 1, rows
    return rows[0]


def parse(tmp_path: Path, row: dict) -> Prompt | BadRow:
    return only(write_jsonl(tmp_path / "one.jsonl", [row]))


# --- input forms ---------------------------------------------------------------------------

def test_conversations_with_role_content(tmp_path):
    p = parse(tmp_path, {"id": "a", "conversations": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]})
    assert p == Prompt(id="a", line=1, messages=(
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}))


def test_messages_field(tmp_path):
    p = parse(tmp_path, {"id": "a", "messages": [{"role": "user", "content": "hi"}]})
    assert p.messages == USER_HI


def test_sharegpt_from_value(tmp_path):
    p = parse(tmp_path, {"id": "a", "conversations": [
        {"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
        {"from": "human", "value": "q2"}]})
    assert p.messages == ({"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                          {"role": "user", "content": "q2"})


def test_prompt_field(tmp_path):
    p = parse(tmp_path, {"id": "a", "prompt": "hi"})
    assert p.messages == USER_HI


def test_prompt_with_system(tmp_path):
    p = parse(tmp_path, {"id": "a", "prompt": "hi", "system": "be brief"})
    assert p.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"})


def test_empty_system_beside_prompt_is_omitted(tmp_path):
    assert parse(tmp_path, {"prompt": "hi", "system": ""}).messages == USER_HI


def test_text_content_parts_are_joined(tmp_path):
    p = parse(tmp_path, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]})
    assert p.messages == ({"role": "user", "content": "one\ntwo"},)


def test_turns_keep_only_role_and_content(tmp_path):
    p = parse(tmp_path, {"messages": [{"role": "user", "content": "hi", "name": "x", "weight": 1}]})
    assert p.messages == USER_HI


@pytest.mark.parametrize("name, role", [
    ("human", "user"), ("user", "user"), ("User", "user"),
    ("gpt", "assistant"), ("assistant", "assistant"), ("model", "assistant"),
    ("chatgpt", "assistant"), ("bing", "assistant"),
    ("system", "system"),
    ("tool", "tool"), ("function", "tool"), ("observation", "tool"),
])
def test_role_normalisation(tmp_path, name, role):
    p = parse(tmp_path, {"conversations": [{"from": name, "value": "x"}, {"from": "human", "value": "q"}]})
    assert p.messages[0] == {"role": role, "content": "x"}


def test_conversation_may_end_with_tool_turn(tmp_path):
    p = parse(tmp_path, {"messages": [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "calling"},
                                      {"role": "tool", "content": "42"}]})
    assert p.messages[-1] == {"role": "tool", "content": "42"}


def test_trailing_assistant_turns_dropped(tmp_path):
    p = parse(tmp_path, {"messages": [
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"},
        {"role": "assistant", "content": "a2 continued"}]})
    assert [m["content"] for m in p.messages] == ["q1", "a1", "q2"]


def test_dropped_trailing_assistant_content_is_not_checked(tmp_path):
    p = parse(tmp_path, {"messages": [{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": None}]})
    assert p.messages == USER_HI


def test_conversations_take_precedence_over_prompt(tmp_path):
    p = parse(tmp_path, {"prompt": "ignored", "messages": [{"role": "user", "content": "hi"}]})
    assert p.messages == USER_HI


# --- ids -----------------------------------------------------------------------------------

def test_int_id_becomes_string(tmp_path):
    assert parse(tmp_path, {"id": 42, "prompt": "hi"}).id == "42"


def test_hashed_id_follows_documented_rule(tmp_path):
    p = parse(tmp_path, {"prompt": "hi"})
    assert p.id == content_id(USER_HI)
    assert p.id == "h" + hashlib.blake2b(b'[{"content":"hi","role":"user"}]', digest_size=12).hexdigest()


def test_hashed_id_is_equal_across_equivalent_forms(tmp_path):
    forms = [
        {"prompt": "hi"},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"conversations": [{"from": "human", "value": "hi"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {"id": None, "prompt": "hi", "extra": "ignored"},
    ]
    rows = list(iter_rows(write_jsonl(tmp_path / "forms.jsonl", forms)))
    assert {r.id for r in rows} == {content_id(USER_HI)}


def test_hashed_id_differs_for_different_content(tmp_path):
    rows = list(iter_rows(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}, {"prompt": "hi!"},
                                                             {"prompt": "hi", "system": "s"}])))
    assert len({r.id for r in rows}) == 3


def test_hashed_id_is_stable(tmp_path):
    # Pinned values: a change to the rule would re-key every dataset, so it must not go unnoticed.
    assert parse(tmp_path, {"prompt": "hi"}).id == "h589f3c8007c396dc89dd2eb4"
    assert content_id([{"role": "system", "content": "be brief"},
                       {"role": "user", "content": "héllo 世界"}]) == "h47f4d9581be7cc833f32ecbf"


# --- bad rows ------------------------------------------------------------------------------

def test_malformed_json_reported_and_good_rows_still_read(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [
        {"id": "a", "prompt": "one"}, '{"id": "b" "prompt": "two"}', {"id": "c", "prompt": "three"}])
    rows = list(iter_rows(path))
    assert [type(r) for r in rows] == [Prompt, BadRow, Prompt]
    assert rows[1] == BadRow(line=2, reason="line 2: not valid JSON (Expecting ',' delimiter at column 12)")
    assert [r.line for r in rows] == [1, 2, 3]


def test_blank_lines_skipped_but_counted_in_line_numbers(tmp_path):
    path = tmp_path / "blank.jsonl"
    path.write_text('\n{"prompt": "a"}\n   \n\n{"prompt": "b"}\n')
    assert [r.line for r in iter_rows(path)] == [2, 5]


@pytest.mark.parametrize("row, reason", [
    ({"messages": []}, "conversation is empty"),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "a", "value": "y"},
                        {"from": "narrator", "value": "z"}]}, "unknown role 'a' in turn 2"),
    ({"messages": [{"role": "user", "content": {"text": "hi"}}]},
     "content of turn 1 is an object, not a string"),
    ({"messages": [{"role": "user", "content": 5}]}, "content of turn 1 is a number, not a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "content of turn 1 has a non-text part ('image_url')"),
    ({"messages": [{"role": "user"}]}, "turn 1 has no content"),
    ({"messages": [{"content": "hi"}]}, "turn 1 has no 'role' or 'from'"),
    ({"messages": ["hi"]}, "turn 1 is a string, not an object"),
    ({"messages": "hi"}, "'messages' is a string, not a list of turns"),
    ({"messages": [{"role": "assistant", "content": "a"}]}, "no user turn to answer (only assistant turns)"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]},
     "no user turn to answer (conversation ends with a system turn)"),
    ({"messages": [{"role": "user", "content": "  "}]}, "turn 1, the one to answer, is empty"),
    ({"prompt": ""}, "'prompt' is empty"),
    ({"prompt": ["hi"]}, "'prompt' is a list, not a string"),
    ({"prompt": "hi", "system": 3}, "'system' is a number, not a string"),
    ({"prompt": "\ud800"}, "contains an unpaired surrogate escape (invalid Unicode)"),
    ({"messages": [{"role": "user", "content": "x\udc00"}]},
     "contains an unpaired surrogate escape (invalid Unicode)"),
    ({"id": 1.5, "prompt": "hi"}, "'id' is a number, not a string or integer"),
    ({"id": True, "prompt": "hi"}, "'id' is a boolean, not a string or integer"),
    ({"id": "", "prompt": "hi"}, "'id' is empty"),
    ({"id": "x", "text": "hi"}, "no 'conversations', 'messages' or 'prompt' field"),
])
def test_bad_row_reasons(tmp_path, row, reason):
    assert parse(tmp_path, row) == BadRow(line=1, reason=f"line 1: {reason}")


def test_unknown_role_reason_names_line_and_turn(tmp_path):
    rows = [{"prompt": "ok"}] * 16 + [{"conversations": [
        {"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}, {"from": "narrator", "value": "c"}]}]
    bad = list(iter_rows(write_jsonl(tmp_path / "r.jsonl", rows)))[-1]
    assert bad == BadRow(line=17, reason="line 17: unknown role 'narrator' in turn 3")


@pytest.mark.parametrize("line, reason", [
    ("[1, 2]", "not a JSON object (got a list)"),
    ('"just a string"', "not a JSON object (got a string)"),
])
def test_non_object_lines(tmp_path, line, reason):
    assert parse_raw(tmp_path, line.encode()) == BadRow(line=1, reason=f"line 1: {reason}")


def test_escaped_surrogate_pair_is_valid(tmp_path):
    p = parse_raw(tmp_path, b'{"prompt": "smile \\ud83d\\ude00"}')
    assert p.messages == ({"role": "user", "content": "smile \U0001F600"},)


@pytest.mark.parametrize("line, expected", [
    # What the fast parser (orjson) refuses or reads otherwise is read as the stdlib reads it.
    (b'{"id": 123456789012345678901234567890, "prompt": "x"}', "123456789012345678901234567890"),
    (b'\xef\xbb\xbf{"id": "bom", "prompt": "x"}', "bom"),
    (b'{"id": "nan", "prompt": "x", "score": NaN}', "nan"),
    (b'{"id": "twice", "id": "last", "prompt": "x"}', "last"),
])
def test_lines_the_fast_parser_refuses_read_as_the_stdlib_reads_them(tmp_path, line, expected):
    assert parse_raw(tmp_path, line).id == expected


def test_invalid_utf8_line_is_a_bad_row(tmp_path):
    bad = parse_raw(tmp_path, b'{"prompt": "\xff"}')
    assert isinstance(bad, BadRow) and bad.reason.startswith("line 1: not valid UTF-8")


def parse_raw(tmp_path: Path, line: bytes) -> Prompt | BadRow:
    path = tmp_path / "raw.jsonl"
    path.write_bytes(line + b"\n")
    return only(path)


# --- read_prompts --------------------------------------------------------------------------

def test_duplicates_counted_and_yielded_once(tmp_path):
    path = write_jsonl(tmp_path / "dup.jsonl", [
        {"id": "a", "prompt": "one"}, {"id": "a", "prompt": "other text, same id"},
        {"prompt": "same"}, {"conversations": [{"from": "human", "value": "same"}]},
        {"id": 7, "prompt": "x"}, {"id": "7", "prompt": "y"}])
    summary = ReadSummary()
    prompts = list(read_prompts(path, summary=summary))
    assert [p.line for p in prompts] == [1, 3, 5]
    assert (summary.rows, summary.valid, summary.duplicates, summary.bad) == (6, 6, 3, [])
    # each named: its line, its id, and the line whose prompt is kept
    hashed = prompts[1].id
    assert summary.duplicate_rows == [(2, "a", 1), (4, hashed, 3), (6, "7", 5)]
    assert summary.unit == "line"


def test_bad_rows_recorded_not_raised(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}, "{oops", {"messages": []}, {"prompt": "b"}])
    summary = ReadSummary()
    assert [p.messages[0]["content"] for p in read_prompts(path, summary=summary)] == ["a", "b"]
    assert [b.line for b in summary.bad] == [2, 3]
    assert (summary.rows, summary.valid) == (4, 2)


def test_limit_counts_unique_valid_prompts_and_stops_reading(tmp_path):
    path = write_jsonl(tmp_path / "lim.jsonl", [
        {"id": "a", "prompt": "1"}, "not json", {"id": "a", "prompt": "1"}, {"id": "b", "prompt": "2"},
        {"id": "c", "prompt": "3"}, {"id": "d", "prompt": "4"}])
    summary = ReadSummary()
    assert [p.id for p in read_prompts(path, limit=2, summary=summary)] == ["a", "b"]
    assert summary.rows == 4  # rows after the limit are not read
    assert list(read_prompts(path, limit=0)) == []
    assert len(list(read_prompts(path, limit=100))) == 4


def test_negative_limit_rejected(tmp_path):
    with pytest.raises(ValueError):
        read_prompts(write_jsonl(tmp_path / "x.jsonl", []), limit=-1)


# --- files ---------------------------------------------------------------------------------

ROWS = [{"id": "a", "prompt": "one"}, {"conversations": [{"from": "human", "value": "two"}]}, {"x": 1}]


def check_rows(path: Path) -> None:
    rows = list(iter_rows(path))
    assert [type(r) for r in rows] == [Prompt, Prompt, BadRow]
    assert rows[0] == Prompt(id="a", messages=({"role": "user", "content": "one"},), line=1)
    assert rows[1].messages == ({"role": "user", "content": "two"},) and rows[1].line == 2


def test_jsonl_zst(tmp_path):
    data = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    path = tmp_path / "d.jsonl.zst"
    # Two frames, as written by concatenating compressed chunks.
    path.write_bytes(zstandard.ZstdCompressor().compress(data[:30]) + zstandard.ZstdCompressor().compress(data[30:]))
    check_rows(path)


def test_jsonl_gz(tmp_path):
    path = tmp_path / "d.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in ROWS)
    check_rows(path)


def test_json_extension_is_json_lines(tmp_path):
    check_rows(write_jsonl(tmp_path / "d.json", ROWS))


def test_parquet(tmp_path):
    table = pa.table({
        "id": ["a", None, "c", None],
        "conversations": [None, [{"from": "human", "value": "two"}], None,
                          [{"from": "gpt", "value": "only an answer"}]],
        "prompt": ["one", None, None, None],
        "response": ["ignored"] * 4,
    })
    path = tmp_path / "d.parquet"
    pq.write_table(table, path, row_group_size=2)  # rows span two row groups
    rows = list(iter_rows(path))
    assert rows[0] == Prompt(id="a", messages=({"role": "user", "content": "one"},), line=1)
    assert rows[1].messages == ({"role": "user", "content": "two"},) and rows[1].line == 2
    assert rows[2] == BadRow(line=3, reason="row 3: no 'conversations', 'messages' or 'prompt' field")
    assert rows[3] == BadRow(line=4, reason="row 4: no user turn to answer (only assistant turns)")


def test_parquet_int_ids_and_messages(tmp_path):
    table = pa.table({"id": [1, 2], "messages": [[{"role": "user", "content": "hi"}],
                                                 [{"role": "user", "content": "yo"}]]})
    pq.write_table(table, tmp_path / "m.parquet")
    assert [(p.id, p.line) for p in read_prompts(tmp_path / "m.parquet")] == [("1", 1), ("2", 2)]


def test_parquet_without_a_prompt_column_is_a_dataset_error(tmp_path):
    pq.write_table(pa.table({"text": ["hi"]}), tmp_path / "t.parquet")
    with pytest.raises(DatasetError, match="t.parquet: no 'conversations', 'messages' or 'prompt' column"):
        list(iter_rows(tmp_path / "t.parquet"))


def test_missing_file_raises_on_call(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetError, match="nope.jsonl: no such file"):
        iter_rows(path)
    with pytest.raises(DatasetError, match="nope.jsonl: no such file"):
        read_prompts(str(path))


def test_unsupported_extension_raises(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("prompt\nhi\n")
    with pytest.raises(DatasetError, match="data.csv: unsupported dataset file type"):
        read_prompts(path)
    assert issubclass(DatasetError, ValueError)


def test_corrupt_compressed_file_raises_dataset_error(tmp_path):
    path = tmp_path / "broken.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"prompt": "a"}\n' * 1000)[:60])
    with pytest.raises(DatasetError, match="broken.jsonl.gz: cannot read"):
        list(iter_rows(path))


def test_file_that_is_not_parquet_raises_dataset_error(tmp_path):
    path = tmp_path / "fake.parquet"
    path.write_text('{"prompt": "hi"}\n')
    with pytest.raises(DatasetError, match="fake.parquet: cannot read Parquet"):
        list(iter_rows(path))


# --- every reply regenerated (enqueue --turns all) ---------------------------------------------

def test_every_turn_makes_a_script_with_a_slot_per_reply(tmp_path):
    """Each run of assistant turns after the first user turn becomes one slot, its text unread
    (a tool-calling turn has none); a leading assistant turn, which answers nothing, a system
    turn and a tool turn keep their content; trailing replies are the last, implied."""
    from dflash_tasks.core.conversation import SLOT, context, replies

    row = {"conversations": [
        {"role": "assistant", "content": "Welcome."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "the dataset's last answer"}]}
    path = write_jsonl(tmp_path / "c.jsonl", [row])
    (script,) = [p.messages for p in read_prompts(path, every_turn=True)]
    assert list(script) == [
        {"role": "assistant", "content": "Welcome."}, {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a"}, SLOT, {"role": "tool", "content": "42"}, SLOT,
        {"role": "user", "content": "b"}]
    assert replies(script) == 3
    assert context(script, ["r1"])[-1] == {"role": "tool", "content": "42"}
    assert context(script, ["r1", "r2"])[-2:] == [{"role": "assistant", "content": "r2"},
                                                  {"role": "user", "content": "b"}]
    # Without --turns all the tool-calling turn, which has no text, is a bad row.
    (bad,) = list(iter_rows(path))
    assert isinstance(bad, BadRow) and "turn 4 has no content" in bad.reason


def test_every_turn_ids_ignore_the_datasets_replies(tmp_path):
    """Two conversations that differ only in the replies the target regenerates are one prompt
    under --turns all (their ids are the script's), and two under --turns last."""
    a = {"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "one"},
                           {"from": "human", "value": "q2"}]}
    b = {"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "two"},
                           {"from": "human", "value": "q2"}]}
    path = write_jsonl(tmp_path / "c.jsonl", [a, b])
    summary = ReadSummary()
    assert len(list(read_prompts(path, summary=summary, every_turn=True))) == 1
    assert summary.duplicates == 1
    assert len(list(read_prompts(path))) == 2
