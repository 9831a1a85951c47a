"""A conversation whose every assistant turn the target regenerates (`enqueue --turns all`).

The prompt is stored as its *script*: the dataset's turns, each assistant reply the target is to
give replaced by a slot, `{"role": "assistant", "content": null}` (the dataset's reply, written
by another model, is dropped), and the last reply, after the script's last turn, implied. A run
of assistant turns is one reply; a leading one, before any user turn, answers nothing and keeps
its content, as do the system and tool turns.

Turn k (0-based) is generated after `context(script, replies)`: the script up to its k-th slot,
each earlier slot filled with the visible content of the target's own reply there. That is the
history a chat client sends back when it serves (the answer, not the reasoning), and what Qwen3's
template renders of an earlier assistant turn whatever it is sent: its reasoning is dropped.
"""
from __future__ import annotations

from typing import Sequence

SLOT = {"role": "assistant", "content": None}


def is_slot(message: dict) -> bool:
    return message.get("role") == "assistant" and message.get("content") is None


def is_script(messages: Sequence[dict]) -> bool:
    """Whether the prompt is a conversation of several replies to generate."""
    return any(is_slot(m) for m in messages)


def replies(messages: Sequence[dict]) -> int:
    """How many replies the prompt asks for: one per slot, and the last."""
    return sum(1 for m in messages if is_slot(m)) + 1


def context(script: Sequence[dict], given: Sequence[str]) -> list[dict]:
    """The messages reply number len(given) is generated after, the earlier slots filled with
    the visible content of the replies `given` there."""
    return filled(script, [{"role": "assistant", "content": text} for text in given])


def filled(script: Sequence[dict], turns: Sequence[dict]) -> list[dict]:
    """The script up to the slot of reply number len(turns) (or whole), its earlier slots
    replaced, in order, by `turns`."""
    out: list[dict] = []
    made = iter(turns)
    for message in script:
        if is_slot(message):
            turn = next(made, None)
            if turn is None:
                return out
            out.append(turn)
        else:
            out.append(message)
    return out


def after(script: Sequence[dict], done: int) -> list[dict]:
    """The script's turns after the slot of reply number `done` (0-based): what a conversation
    that ended there leaves unanswered."""
    seen = 0
    for i, message in enumerate(script):
        if is_slot(message):
            if seen == done:
                return list(script[i + 1:])
            seen += 1
    return []
