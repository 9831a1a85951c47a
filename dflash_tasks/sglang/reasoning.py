"""Reasoning and answer apart, as SGLang 0.5.23's chat endpoint splits them.

A continued generation's text is decoded from all its ids at once (ongoing.py), then split here
exactly as the server would have split the text of one uninterrupted request, so the row is the
one that request gives. Mirrors, for the parsers this project serves, the non-streaming path of
`sglang/srt/parser/reasoning_parser.py` (`BaseReasoningFormatDetector._detect_and_parse_impl`,
`Qwen3Detector`) and `serving_chat.py`, quoted in docs/SGLANG_0.5.23.md:

- with thinking on, the qwen3 parser forces reasoning (its `reasoning_default` is
  "enable_thinking"): everything up to `</think>` is reasoning, leading `<think>` tags dropped;
- with thinking off, only a text that holds `<think>` has reasoning; otherwise it is all answer;
- nothing is stripped: the newlines around `</think>` stay where the model wrote them;
- no `</think>`: all reasoning, unless a `<tool_call>` interrupts it (the rest is the answer);
- an empty reasoning is reported as null, an empty answer as "".

tests/sglang_checks.py's `check_cut_at_every_offset` holds this against the real server.
"""
from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_START = "<tool_call>"
# The parsers whose split this module reproduces (SGLang maps each to its Qwen3Detector).
QWEN3_LIKE = frozenset({"qwen3", "qwen3-thinking", "dots", "interns1", "nanbeige", "minimax"})
# Those that force reasoning whatever the request says.
ALWAYS_REASONING = frozenset({"qwen3-thinking", "minimax"})


class UnsupportedParser(ValueError):
    """A reasoning parser whose split this project does not reproduce."""


def supported(parser: str | None) -> bool:
    return parser is None or parser.lower() in QWEN3_LIKE


def split_reasoning(text: str, *, parser: str | None, enable_thinking: bool) -> tuple[str | None, str]:
    """(reasoning_content, content) of a whole generation's text, as the server answers them."""
    if parser is None:
        return None, text  # no parser: the reasoning stays in the answer
    name = parser.lower()
    if name not in QWEN3_LIKE:
        raise UnsupportedParser(f"reasoning parser {parser!r}: a continued row is split only for "
                                f"{', '.join(sorted(QWEN3_LIKE))}")
    forced = enable_thinking or name in ALWAYS_REASONING
    if not forced and THINK_START not in text:
        return None, text
    body = text
    while body.startswith(THINK_START):
        body = body[len(THINK_START):]
    if THINK_END not in body:
        tool = body.find(TOOL_START)
        if tool != -1:
            return body[:tool] or None, body[tool:]
        return body or None, ""
    reasoning, answer = body.split(THINK_END, 1)
    return reasoning or None, answer
