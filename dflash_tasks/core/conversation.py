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

Its row (output/rows.py's build_conversation_row) holds every reply; what it trains as is one row
per reply (`reply_rows`). A single sequence holding every reply under the loss mask would train
each earlier reply's reasoning in a context the model never sees when it serves, so a
conversation is expanded as SpecForge's own docs expand multi-turn reasoning data
(`scripts/expand_reasoning_conversations.py`, trained with `train_only_last_turn: true`): reply
k's row is the conversation up to it, the earlier replies with their content only, and reply k
whole; its token ids are the ones the server rendered and generated for it, its status and
figures its own. Every reply is under the loss mask exactly once, in its own context. Its id is
the conversation's and `/turn<k>` (1-based); its metadata names the `turn` and the
conversation's `turns` count.
"""
from __future__ import annotations

from typing import Sequence

SLOT = {"role": "assistant", "content": None}


def is_slot(message: dict) -> bool:
    """Whether a message of a prompt is a reply to generate (a stored prompt's messages are not
    checked again: one an older tool stored malformed is the server's to refuse)."""
    return isinstance(message, dict) and message.get("role") == "assistant" \
        and message.get("content") is None


def is_script(messages: Sequence[dict]) -> bool:
    """Whether the prompt is a conversation of several replies to generate."""
    return isinstance(messages, list) and any(is_slot(m) for m in messages)


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


# -- a conversation's row ---------------------------------------------------------------------

# A reply's own figures (each of metadata.turns), which replace the conversation's in its row
TURN_FIELDS = ("finish_reason", "prompt_tokens", "completion_tokens", "reasoning_tokens", "gpu",
               "latency_s", "attempts", "gpus")
WHOLE_FIELDS = ("turns", "finish_reasons", "unanswered")


def _replies_at(row: dict) -> list[int] | None:
    """Where a conversation row's replies are in its `conversations` (None: not such a row)."""
    turns = (row.get("metadata") or {}).get("turns")
    if not isinstance(turns, list) or not turns:
        return None
    messages = row.get("conversations") or []
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), 0)
    at = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and i > first_user]
    return at if len(at) == len(turns) else None


def reply_rows(row: dict) -> list[dict]:
    """The row as training reads it: itself, or a conversation's one row per reply (above)."""
    at = _replies_at(row)
    if at is None:
        return [row]
    meta, messages = row["metadata"], row["conversations"]
    ids = row.get("token_ids")
    made = [*ids.get("earlier_turns", ()),
            {"prompt": ids.get("prompt"), "response": ids.get("response")}] \
        if isinstance(ids, dict) else [None] * len(at)
    base = {k: v for k, v in meta.items() if k not in WHOLE_FIELDS and k not in TURN_FIELDS}
    out = []
    for k, (position, turn, turn_ids) in enumerate(zip(at, meta["turns"], made)):
        history = [{"role": "assistant", "content": m.get("content")} if i in at else m
                   for i, m in enumerate(messages[:position])]
        view = {"id": f"{row['id']}/turn{k + 1}",
                "conversations": [*history, messages[position]],
                "status": {"stop": "success", "length": "truncated"}.get(
                    turn["finish_reason"], turn["finish_reason"]),
                "metadata": {**base, **{f: turn[f] for f in TURN_FIELDS if f in turn},
                             "turn": k + 1, "turns": len(at)}}
        if turn_ids is not None and turn_ids.get("prompt") is not None:
            view["token_ids"] = {"prompt": turn_ids["prompt"], "response": turn_ids["response"]}
        out.append(view)
    return out


def script_of(row: dict) -> list[dict] | None:
    """The script a conversation row was generated from (its replies slots again, the turns it
    left unanswered after), for a regenerate; None for a row of one reply."""
    at = _replies_at(row)
    if at is None:
        return None
    messages = row["conversations"][:at[-1]]
    return [dict(SLOT) if i in at else m for i, m in enumerate(messages)] + \
        [dict(SLOT)] * bool(row["metadata"].get("unanswered")) + \
        list(row["metadata"].get("unanswered") or ())


def turn_records(row: dict) -> list[dict]:
    """A conversation row's replies before its last, as its entry kept them between turns
    (output/rows.py's turn_record): for a regenerate that goes on with its last."""
    out = []
    for view in reply_rows(row)[:-1]:
        reply, meta = view["conversations"][-1], view["metadata"]
        record = {"content": reply.get("content"),
                  "reasoning_content": reply.get("reasoning_content"),
                  **{f: meta[f] for f in TURN_FIELDS if f in meta}}
        if "token_ids" in view:
            record["token_ids"] = view["token_ids"]
        out.append(record)
    return out
