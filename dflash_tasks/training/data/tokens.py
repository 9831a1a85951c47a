"""A row's `input_ids` and `loss_mask`: 1 exactly on the tokens the target model generated (its
reasoning, think markers it wrote, its answer, and its end-of-turn token), 0 on the prompt and
on whatever the chat template inserted (the empty think block of a non-thinking generation
prompt, the newline after `<|im_end|>`, a system prompt).

Two ways to get them, which agree on the same row:

1. **The server's own ids** (preferred): SGLang with `return_token_ids` returned the prompt ids
   it fed the model and the ids it generated; the row keeps them as `token_ids.prompt` and
   `token_ids.response`. Then `input_ids = prompt + response` and the mask is 0 on the prompt,
   1 on the response. No re-rendering, no tokenizer, nothing to get wrong.
2. **The target tokenizer's own chat template** (rows without ids): the conversation is rendered
   twice with the same thinking mode the row was generated with (its metadata): the prompt
   turns with the generation prompt, exactly as the server rendered them, and the prompt turns
   plus the assistant turn. The template's own structure then says where the assistant's
   tokens are: everything the second rendering adds after the first, up to and including the
   end-of-turn token (found by its id, not by a pattern over text). Rendering text, never
   re-tokenizing a whole conversation at once, keeps the prompt ids identical to the server's.

A truncated row (finish_reason "length") never generated its end-of-turn token, so the template
path drops the one the template appends; when the cut struck inside the reasoning (no answer),
the `</think>` the template closes it with is dropped too. A row cut right after `</think>`
looks the same as one cut inside the reasoning: only the server's ids tell them apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

# Qwen3's special ids, as the simulated server and the real tokenizer use them.
IM_START = 151644
IM_END = 151645          # end of turn: the last token the assistant generates
THINK = 151667
END_THINK = 151668
EOT_TOKEN = "<|im_end|>"
END_THINK_TOKEN = "</think>"


class TokenizeError(ValueError):
    """A row cannot be turned into input_ids and a loss mask; the message says why."""


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]
    source: str        # "server" (the ids the server returned) or "template"
    prompt_len: int

    @property
    def loss_tokens(self) -> int:
        return len(self.input_ids) - self.prompt_len

    def __len__(self) -> int:
        return len(self.input_ids)

    def cut(self, max_length: int) -> "Tokenized":
        """Its first max_length tokens (SpecForge trains a longer row so: its first
        data.max_length), the loss mask cut with them."""
        return Tokenized(self.input_ids[:max_length], self.loss_mask[:max_length], self.source,
                         min(self.prompt_len, max_length))


def _masked(prompt: Sequence[int], response: Sequence[int], source: str) -> Tokenized:
    return Tokenized(list(prompt) + list(response), [0] * len(prompt) + [1] * len(response),
                     source, len(prompt))


def from_server_ids(row: dict) -> Tokenized | None:
    """The row's tokens from the ids the server returned, or None when it has none."""
    ids = row.get("token_ids")
    if not isinstance(ids, dict) or ids.get("prompt") is None or ids.get("response") is None:
        return None
    return _masked(ids["prompt"], ids["response"], "server")


def row_thinking(row: dict) -> bool:
    """The thinking mode the row was generated with (SGLang's default, on, when unrecorded)."""
    value = (row.get("metadata") or {}).get("enable_thinking")
    return True if value is None else bool(value)


def is_truncated(row: dict) -> bool:
    return row.get("status") == "truncated" or \
        (row.get("metadata") or {}).get("finish_reason") == "length"


def split_row(row: dict) -> tuple[list[dict], dict]:
    """(prompt turns, the generated assistant turn)."""
    conv = row.get("conversations") or []
    if not conv or conv[-1].get("role") != "assistant":
        raise TokenizeError(f"row {row.get('id')!r}: its last turn is not the assistant's")
    return list(conv[:-1]), conv[-1]


class ChatTemplate:
    """The target tokenizer (a local directory with tokenizer.json and tokenizer_config.json,
    or any tokenizer object with `apply_chat_template`, `encode` and `convert_tokens_to_ids`)."""

    def __init__(self, tokenizer: Any, *, eot_token: str | None = None):
        self.tokenizer = tokenizer
        self.eot_id = self._id(eot_token or EOT_TOKEN)
        if self.eot_id is None and getattr(tokenizer, "eos_token", None):
            self.eot_id = self._id(tokenizer.eos_token)
        if self.eot_id is None:
            raise TokenizeError(f"the tokenizer has no {EOT_TOKEN} token and no eos_token: "
                                "pass eot_token")
        self.end_think_id = self._id(END_THINK_TOKEN)

    @classmethod
    def load(cls, path: str | Path, **kwargs) -> "ChatTemplate":
        from transformers import AutoTokenizer

        path = Path(path)
        if not path.is_dir():
            raise TokenizeError(f"{path}: not a directory with a tokenizer (tokenizer.json, "
                                "tokenizer_config.json with a chat_template)")
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if not getattr(tok, "chat_template", None):
            raise TokenizeError(f"{path}: the tokenizer has no chat_template")
        return cls(tok, **kwargs)

    def _id(self, token: str) -> int | None:
        tid = self.tokenizer.convert_tokens_to_ids(token)
        unk = getattr(self.tokenizer, "unk_token_id", None)
        return None if tid is None or (unk is not None and tid == unk) else int(tid)

    def render(self, messages: list[dict], *, generation_prompt: bool, thinking: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt,
            enable_thinking=thinking)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict], thinking: bool) -> list[int]:
        """What the server fed the model for these prompt turns."""
        return self.encode(self.render(messages, generation_prompt=True, thinking=thinking))

    def tokenize(self, row: dict) -> Tokenized:
        prompt_turns, answer = split_row(row)
        thinking = row_thinking(row)
        content = answer.get("content") or ""
        reasoning = answer.get("reasoning_content")
        turn = {"role": "assistant", "content": content}
        if isinstance(reasoning, str):
            turn["reasoning_content"] = reasoning
        prompt_text = self.render(prompt_turns, generation_prompt=True, thinking=thinking)
        full_text = self.render(prompt_turns + [turn], generation_prompt=False, thinking=thinking)
        if not full_text.startswith(prompt_text):
            raise TokenizeError(
                f"row {row.get('id')!r}: the chat template renders the conversation with its "
                "answer so that the generation prompt is not its prefix (does it re-render "
                "earlier turns, or drop the think block?): the loss mask cannot be placed")
        completion = self.encode(full_text[len(prompt_text):])
        ends = [i for i, t in enumerate(completion) if t == self.eot_id]
        if not ends:
            raise TokenizeError(f"row {row.get('id')!r}: the template's assistant turn has no "
                                "end-of-turn token")
        generated = completion[:ends[-1] + 1]  # what follows <|im_end|> is the template's
        if is_truncated(row):
            generated = generated[:-1]  # the cap struck first: no end-of-turn was generated
            if thinking and not content.strip() and self.end_think_id in generated:
                cut = len(generated) - 1 - generated[::-1].index(self.end_think_id)
                generated = generated[:cut]  # nor the </think> closing unfinished reasoning
        return _masked(self.encode(prompt_text), generated, "template")


def tokenize_row(row: dict, template: ChatTemplate | None = None, *,
                 prefer: str = "server") -> Tokenized:
    """The row's tokens: the server's ids when the row has them (prefer="server"), else the
    template's rendering; raises TokenizeError when neither is possible."""
    if prefer not in ("server", "template"):
        raise ValueError(f"prefer must be 'server' or 'template', not {prefer!r}")
    if prefer == "server" or template is None:
        tok = from_server_ids(row)
        if tok is not None:
            return tok
    if template is None:
        raise TokenizeError(f"row {row.get('id')!r} has no token ids from the server: pass "
                            "the target tokenizer (--tokenizer PATH) to render it")
    return template.tokenize(row)


@dataclass
class Agreement:
    prompt_equal: bool
    tokens_equal: bool
    mask_equal: bool


def compare(row: dict, template: ChatTemplate) -> Agreement | None:
    """Both paths on one row that has server ids (None if it has none). The prompts must be
    equal (the server rendered the same template); the responses are, unless the generated ids
    are not the canonical tokenization of their own text (possible with a real BPE)."""
    server = from_server_ids(row)
    if server is None:
        return None
    prompt_turns, _ = split_row(row)
    prompt_equal = template.prompt_ids(prompt_turns, row_thinking(row)) == \
        server.input_ids[:server.prompt_len]
    try:
        rendered = template.tokenize(row)
    except TokenizeError:
        return Agreement(prompt_equal, False, False)
    return Agreement(prompt_equal, rendered.input_ids == server.input_ids,
                     rendered.loss_mask == server.loss_mask)
