"""One output row per prompt, in SpecForge's regenerated-data shape plus our metadata.

    {"id", "conversations": [prompt turns..., {"role": "assistant", "content",
     "reasoning_content"}], "status", "metadata": {...}, "token_ids"?: {"prompt", "response"}}

A conversation whose every reply was generated (`enqueue --turns all`, core/conversation.py) is
one row too: `conversations` holds each reply, in place, with its reasoning; `metadata` counts the
whole conversation (tokens summed over its replies, `finish_reason` its last reply's) and has
`turns`, each reply's own figures, and `finish_reasons`; `token_ids` holds the last reply's
`prompt` and `response` and `earlier_turns`, the others' `{"prompt", "response"}`: each reply's
ids in the context it was generated in. A reply cut at the cap ends the conversation there; the
turns left unanswered are `metadata.unanswered`.

`metadata.loop` ({"period", "repeats", "tokens"}) marks an output that ends in a repetition loop
(output/loops.py), whatever its finish reason; absent otherwise.

`status` is "success" only for a generation that ended by itself; a truncated one says
"truncated" (finish_reason "length"), so it is never trained on as a finished answer by mistake.

Its thinking mode is three facts, all recorded: `enable_thinking` (the job's, sent with the
request), and what the server decided: `chat_template` (the fingerprint of the template that
rendered the prompt) and `reasoning_parser` (what split the reasoning from the answer). The
training gate refuses to mix rows that differ in any of them (training/data/thinking.py).
"""
from __future__ import annotations

import time

from dflash_tasks.core import conversation
from dflash_tasks.core.jobs import GenerationParams
from dflash_tasks.core.keys import GpuName
from dflash_tasks.output.loops import loop_metadata
from dflash_tasks.sglang import Completion, ServerContract


def status_for(finish_reason: str) -> str:
    return {"stop": "success", "length": "truncated"}.get(finish_reason, finish_reason)


def turn_record(c: Completion, *, gpu: GpuName, attempts: int) -> dict:
    """One reply of a conversation, as its entry keeps it between turns and its row records it."""
    turn = {"content": c.content, "reasoning_content": c.reasoning_content,
            "finish_reason": c.finish_reason, "prompt_tokens": c.prompt_tokens,
            "completion_tokens": c.completion_tokens, "reasoning_tokens": c.reasoning_tokens,
            "gpu": gpu, "latency_s": round(c.latency_s, 3), "attempts": attempts}
    if c.worked:
        turn["gpus"] = [share.stored() for share in c.worked]
    if c.prompt_token_ids is not None and c.response_token_ids is not None:
        turn["token_ids"] = {"prompt": c.prompt_token_ids, "response": c.response_token_ids}
    return turn


def build_conversation_row(prompt_id: str, script: list[dict], turns: list[dict], *,
                           last: Completion, job: str, gpu: GpuName, params: GenerationParams,
                           server: ServerContract) -> dict:
    """The row of a conversation whose replies are `turns` (turn_record's, the last one's
    Completion `last`): each reply in its place, the whole conversation's figures."""
    replies = [{"role": "assistant", "content": t["content"],
                "reasoning_content": t["reasoning_content"]} for t in turns]
    messages = conversation.filled(script, replies[:-1])
    row = build_row(prompt_id, messages, last, job=job, gpu=gpu, params=params,
                    attempts=sum(t["attempts"] for t in turns), server=server)
    meta = row["metadata"]
    for name in ("prompt_tokens", "completion_tokens", "reasoning_tokens"):
        meta[name] = sum(t[name] for t in turns)
    meta["latency_s"] = round(sum(t["latency_s"] for t in turns), 3)
    meta["finish_reasons"] = [t["finish_reason"] for t in turns]
    meta["turns"] = [{k: v for k, v in t.items()
                      if k not in ("content", "reasoning_content", "token_ids")} for t in turns]
    if unanswered := conversation.after(script, len(turns) - 1):
        meta["unanswered"] = unanswered
    if "token_ids" in row:
        row["token_ids"]["earlier_turns"] = [t.get("token_ids") for t in turns[:-1]]
    return row


def build_row(prompt_id: str, messages: list[dict], c: Completion, *, job: str, gpu: GpuName,
              params: GenerationParams, attempts: int, server: ServerContract) -> dict:
    row = {
        "id": prompt_id,
        "conversations": [*messages, {"role": "assistant", "content": c.content,
                                      "reasoning_content": c.reasoning_content}],
        "status": status_for(c.finish_reason),
        "metadata": {
            "job": job,
            "finish_reason": c.finish_reason,
            "prompt_tokens": c.prompt_tokens,
            "completion_tokens": c.completion_tokens,
            "reasoning_tokens": c.reasoning_tokens,
            "max_tokens": params.max_tokens,
            "enable_thinking": params.enable_thinking,
            "chat_template": server.chat_template,
            "reasoning_parser": server.reasoning_parser,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "min_p": params.min_p,
            "repetition_penalty": params.repetition_penalty,
            "gpu": gpu,
            "model": c.model,
            "latency_s": round(c.latency_s, 3),
            "attempts": attempts,
            "completed_at": round(time.time(), 3),
        },
    }
    if c.continued_tokens:  # the first tokens come from an earlier, truncated row
        row["metadata"]["continued_tokens"] = c.continued_tokens
    if c.worked:  # made in more than one request (sglang/ongoing.py): each GPU's share, in order
        row["metadata"]["gpus"] = [share.stored() for share in c.worked]
    if c.prompt_token_ids is not None and c.response_token_ids is not None:
        row["token_ids"] = {"prompt": c.prompt_token_ids, "response": c.response_token_ids}
    if loop := loop_metadata(c.response_token_ids):  # its output ends in a loop (loops.py)
        row["metadata"]["loop"] = loop
    return row
