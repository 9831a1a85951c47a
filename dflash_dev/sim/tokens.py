"""A tiny deterministic pseudo-tokenizer with Qwen3's chat template, and the simulated model's output ids.

Prompt side: text is split on Qwen3's special tokens, which get their real ids, and on whitespace;
each other piece maps to an id in [0, VOCAB) by CRC-32 (a piece spelled `w<id>`, as the simulated
model writes, maps back to that id). `render_chat` lays messages out as Qwen3's template does:
`<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then `<|im_start|>assistant\\n`, then,
when thinking is off, the empty think block `<think>\\n\\n</think>\\n\\n`.

Output side: a `Layout` says how a response of a given natural length is cut into parts. In
thinking mode it is `<think>`, the reasoning words, `</think>`, the answer words, `<|im_end|>`;
without thinking, the answer words then `<|im_end|>`. Word ids come from one fixed pseudo-random
table read from a per-prompt offset, so the id at position k depends only on the prompt and k: a
continuation reproduces exactly the ids a single longer generation would have produced. Text is
one word per token (`w<id>`), words apart by one space and none beside a marker
(`<think>w1 w2</think>w3`), built by slicing and joining, which keeps a response cheap to make.

The byte-level mode (`--tokenizer bytes`) stands for a byte-level BPE such as Qwen's, at its
most unforgiving: every output token is one byte (ids 0-255) of a UTF-8 text of Chinese,
emoji, English and newlines, so nearly every cut between two requests falls inside a character.
A request's text is decoded from its own ids alone (an incomplete character at either end is
U+FFFD, as SGLang's incremental detokenizer leaves it): texts of requests joined are not the text
of their ids joined, which only decoding all the ids at once (`/v1/detokenize`) gives.
"""
from __future__ import annotations

import hashlib
import random
import re
import sys
import zlib
from array import array
from typing import Any, Iterable, Sequence

ENDOFTEXT = 151643
IM_START = 151644
IM_END = 151645
THINK = 151667
END_THINK = 151668
VOCAB = 151643  # ordinary (non-special) ids are in [0, VOCAB)
VOCAB_SIZE = 151936  # Qwen3's embedding size: ids at or above it are rejected as input

SPECIAL_IDS = {
    "<|endoftext|>": ENDOFTEXT,
    "<|im_start|>": IM_START,
    "<|im_end|>": IM_END,
    "<think>": THINK,
    "</think>": END_THINK,
}
SPECIAL_TEXT = {v: k for k, v in SPECIAL_IDS.items()}
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_IDS) + ")")

_TABLE_SIZE = 1 << 16
# What the byte-level mode's model writes, line by line: every character of it is 1 to 4 bytes.
_BYTE_TEXT = ("好的，让我想想这个问题。\n首先 🤔 we need the sum: 3 + 4 = 7 ✅\n"
              "然后检查边界情况 🧮🔍 — naïve café, Ελληνικά, русский текст.\n\n"
              "答案是四十二 🎉 The answer is 42.\n")


def piece_id(piece: str) -> int:
    """The id of one whitespace-free piece of ordinary text."""
    if piece[:1] == "w" and piece[1:].isdigit() and len(piece) < 8:
        value = int(piece[1:])
        if value < VOCAB:
            return value
    return zlib.crc32(piece.encode("utf-8", "surrogatepass")) % VOCAB


def encode(text: str) -> list[int]:
    """Token ids of `text`: special tokens by name, every other whitespace-separated piece hashed."""
    ids: list[int] = []
    for part in _SPECIAL_SPLIT.split(text):
        special = SPECIAL_IDS.get(part)
        if special is not None:
            ids.append(special)
        elif part:
            ids.extend(piece_id(p) for p in part.split())
    return ids


def decode(ids: Iterable[int], *, byte_level: bool = False, skip_special: bool = False) -> str:
    """Text of `ids` decoded at once, as the tokenizer of each mode decodes (see the module's
    docstring); `skip_special`: `<|im_end|>` and the other special tokens left out, the think
    markers kept (added tokens, not special, as in Qwen3). The special tokens are found with
    list.index and the runs between them decoded whole: a /v1/detokenize of 8,192 ids must not
    stall the simulated server's loop."""
    ids = list(ids)
    found = sorted((at, special) for special in SPECIAL_TEXT for at in _positions(ids, special))
    parts: list[str] = []
    start = 0
    for at, special in [*found, (len(ids), None)]:
        if at > start:
            run = ids[start:at]
            parts.append(bytes(run).decode("utf-8", "replace") if byte_level
                         else "w" + " w".join(map(str, run)))
        if special is not None and (not skip_special or special in (THINK, END_THINK)):
            parts.append(SPECIAL_TEXT[special])
        start = at + 1
    return "".join(parts)


def _positions(ids: list[int], value: int) -> list[int]:
    out, at = [], -1
    try:
        while True:
            at = ids.index(value, at + 1)
            out.append(at)
    except ValueError:
        return out


ASSISTANT = piece_id("assistant")


def message_text(content: Any) -> str:
    """The text of a chat message's content: a string, or OpenAI-style parts of type text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def render_chat(messages: Sequence[dict], enable_thinking: bool = True) -> list[int]:
    """Prompt ids of `messages` under the Qwen3 chat template, ending with the generation prompt."""
    ids: list[int] = []
    for message in messages:
        ids.append(IM_START)
        ids.extend(encode(str(message.get("role", ""))))
        ids.extend(encode(message_text(message.get("content"))))
        ids.append(IM_END)
    ids.append(IM_START)
    ids.append(ASSISTANT)
    if not enable_thinking:
        ids.append(THINK)
        ids.append(END_THINK)
    return ids


def prompt_key(prompt_ids: Sequence[int]) -> bytes:
    """16 bytes that identify a prompt: blake2b of its ids as little-endian uint32."""
    packed = array("I", prompt_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return hashlib.blake2b(packed.tobytes(), digest_size=16).digest()


def split_prompt(ids: Sequence[int]) -> tuple[int, bool | None]:
    """Where the prompt ends in `ids` (prompt ids, maybe followed by response ids), and its mode.

    The prompt runs through the last `<|im_start|>assistant` and, when thinking is off, the empty
    think block that follows it. Returns (end, enable_thinking); without an assistant header the
    whole input is the prompt and the mode is None (plain continuation).
    """
    for i in range(len(ids) - 2, -1, -1):
        if ids[i] == IM_START and ids[i + 1] == ASSISTANT:
            end = i + 2
            if tuple(ids[end:end + 2]) == (THINK, END_THINK):
                return end + 2, False
            return end, True
    return len(ids), None


def _build_tables() -> tuple[list[int], list[str], list[int]]:
    rng = random.Random(0x5EED)
    table = [rng.randrange(VOCAB) for _ in range(_TABLE_SIZE)]
    words = [f"w{i}" for i in table]
    # Its lines in a random order, each numbered, with a sum of its own: text that never repeats
    # itself back to back, as a loop does (dflash_tasks/output/loops.py would name it one).
    lines = _BYTE_TEXT.splitlines(keepends=True)
    text = bytearray()
    while len(text) < _TABLE_SIZE:
        a, b = rng.randrange(100), rng.randrange(100)
        text += f"{len(text)}. {a} + {b} = {a + b}: {rng.choice(lines)}".encode()
    raw = list(text[:_TABLE_SIZE])
    # doubled, so any window of up to a table length is a slice
    return table + table, words + words, raw + raw


_IDS2, _WORDS2, _BYTES2 = _build_tables()


def char_start(offset: int) -> int:
    """The first position at or after `offset` of the byte table where a character begins."""
    while _BYTES2[offset % _TABLE_SIZE] & 0xC0 == 0x80:
        offset += 1
    return offset


def _window(seq2: list, start: int, stop: int) -> list:
    """Items start..stop of the infinite periodic sequence stored (doubled) in `seq2`."""
    if stop <= start:
        return []
    first = start % _TABLE_SIZE
    if stop - start <= _TABLE_SIZE:
        return seq2[first:first + stop - start]
    out: list = []
    while start < stop:
        n = min(stop - start, _TABLE_SIZE)
        first = start % _TABLE_SIZE
        out.extend(seq2[first:first + n])
        start += n
    return out


class Layout:
    """How one prompt's natural response is laid out in positions 0..length."""

    __slots__ = ("thinking", "reasoning", "answer", "offset", "length", "byte_level", "head",
                 "loop", "_segments")

    def __init__(self, thinking: bool, reasoning: int, answer: int, offset: int,
                 byte_level: bool = False, head: tuple[int, ...] = (),
                 loop: tuple[int, int] | None = None):
        self.thinking = thinking
        self.byte_level = byte_level
        # Word ids said first, before the table's (a sampled output's salt: lengths.py)
        self.head = head
        # (first word, period): from that word on, the words repeat the `period` before them
        # for ever (a degenerate loop: lengths.py's loop_share)
        self.loop = loop
        offset = char_start(offset) if byte_level else offset
        self.reasoning = reasoning if thinking else 0
        self.answer = answer
        self.offset = offset
        r, a = self.reasoning, answer
        # (special id or None for words, first position, end position, index of its first word)
        if thinking:
            self._segments = ((THINK, 0, 1, 0), (None, 1, 1 + r, 0), (END_THINK, 1 + r, 2 + r, 0),
                              (None, 2 + r, 2 + r + a, r), (IM_END, 2 + r + a, 3 + r + a, 0))
            self.length = r + a + 3
        else:
            self._segments = ((None, 0, a, 0), (IM_END, a, a + 1, 0))
            self.length = a + 1

    def ids(self, start: int, stop: int) -> list[int]:
        """Response ids at positions start..stop (clipped to the natural length)."""
        out: list[int] = []
        for special, s0, s1, base in self._segments:
            lo, hi = max(start, s0), min(stop, s1)
            if lo >= hi:
                continue
            if special is not None:
                out.append(special)
            else:
                words = self._words(_BYTES2 if self.byte_level else _IDS2, base + lo - s0, hi - lo)
                out.extend(self._headed(words, base + lo - s0, as_text=False))
        return out

    def _words(self, seq2: list, first: int, count: int) -> list:
        """Words first..first+count of the response, from the table (`seq2`), looped."""
        if self.loop is None:
            return _window(seq2, self.offset + first, self.offset + first + count)
        start, period = self.loop
        words = []
        if first < start:
            n = min(count, start - first)
            words = _window(seq2, self.offset + first, self.offset + first + n)
            first, count = first + n, count - n
        if count > 0:
            cycle = _window(seq2, self.offset + start, self.offset + start + period)
            k = (first - start) % period
            words += (cycle * ((k + count) // period + 1))[k:k + count]
        return words

    def _headed(self, words: list, first: int, *, as_text: bool) -> list:
        """`words` (the response's words first.. from the table, as ids or as text) with the
        head's words in place of those it covers (none, for an output without a head)."""
        if first >= len(self.head):
            return words
        words = list(words)
        for i in range(first, min(len(self.head), first + len(words))):
            words[i - first] = f"w{self.head[i]}" if as_text else self.head[i]
        return words

    def text(self, start: int, stop: int) -> str:
        """The text of positions start..stop decoded alone (`decode(ids(start, stop),
        skip_special=True)`, made faster): think markers by name, `<|im_end|>` left out."""
        parts: list[str] = []
        for special, s0, s1, base in self._segments:
            lo, hi = max(start, s0), min(stop, s1)
            if lo >= hi or special == IM_END:
                continue
            if special is not None:
                parts.append(SPECIAL_TEXT[special])
            elif self.byte_level:
                parts.append(bytes(self._words(_BYTES2, base + lo - s0, hi - lo))
                             .decode("utf-8", "replace"))
            else:
                words = self._words(_WORDS2, base + lo - s0, hi - lo)
                parts.append(" ".join(self._headed(words, base + lo - s0, as_text=True)))
        return "".join(parts)

    def reasoning_tokens(self, stop: int) -> int:
        """SGLang's usage.reasoning_tokens for positions 0..stop: every token up to and including
        `</think>`, the markers counted (checked against the real 0.5.23 server)."""
        return min(stop, self.reasoning + 2) if self.thinking else 0
