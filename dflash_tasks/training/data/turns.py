"""What a row trains as: itself, or, for a conversation whose every reply was generated (`enqueue
--turns all`, output/rows.py), one training row per reply, ending at that reply.

Each reply was generated after the target's earlier replies as the chat template renders history:
their visible content, their reasoning dropped (Qwen3's template). A single sequence holding every
reply under the loss mask would train each earlier reply's reasoning in a context the model never
sees when it serves, so a conversation is expanded as SpecForge's own docs expand multi-turn
reasoning data (`scripts/expand_reasoning_conversations.py`, trained with
`train_only_last_turn: true`): reply k's row is the conversation up to it, the earlier replies
with their content only, and reply k whole; its token ids are the ones the server rendered and
generated for it (`token_ids.earlier_turns`), its status and figures its own. Every reply is
under the loss mask exactly once, in its own context.

A training row's id is the conversation's and `/turn<k>` (1-based); its metadata names the
`turn` and the conversation's `turns` count.
"""
from __future__ import annotations

from dflash_tasks.output.rows import status_for

# The conversation's figures that a reply's own replace, and those that describe only the whole
TURN_FIELDS = ("finish_reason", "prompt_tokens", "completion_tokens", "reasoning_tokens", "gpu",
               "latency_s", "attempts", "gpus")
WHOLE_FIELDS = ("turns", "finish_reasons", "unanswered")


def training_rows(row: dict) -> list[dict]:
    """The row as training reads it: itself, or a conversation's one row per reply."""
    meta = row.get("metadata") or {}
    turns = meta.get("turns")
    if not isinstance(turns, list) or not turns:
        return [row]
    conversation = row.get("conversations") or []
    first_user = next((i for i, m in enumerate(conversation) if m.get("role") == "user"), 0)
    replies = [i for i, m in enumerate(conversation)
               if m.get("role") == "assistant" and i > first_user]
    ids = row.get("token_ids")
    made = [*ids.get("earlier_turns", ()),
            {"prompt": ids.get("prompt"), "response": ids.get("response")}] \
        if isinstance(ids, dict) else [None] * len(turns)
    if len(replies) != len(turns) or len(made) != len(turns):
        return [row]  # not a conversation this reader knows: trained as it is
    base = {k: v for k, v in meta.items() if k not in WHOLE_FIELDS and k not in TURN_FIELDS}
    out = []
    for k, (at, turn, turn_ids) in enumerate(zip(replies, turns, made)):
        history = [{"role": "assistant", "content": m.get("content")} if i in replies else m
                   for i, m in enumerate(conversation[:at])]
        view = {"id": f"{row['id']}/turn{k + 1}",
                "conversations": [*history, conversation[at]],
                "status": status_for(turn["finish_reason"]),
                "metadata": {**base, **{f: turn[f] for f in TURN_FIELDS if f in turn},
                             "turn": k + 1, "turns": len(turns)}}
        if turn_ids is not None and turn_ids.get("prompt") is not None:
            view["token_ids"] = {"prompt": turn_ids["prompt"], "response": turn_ids["response"]}
        out.append(view)
    return out
