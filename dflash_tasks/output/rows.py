"""One output row per prompt, in SpecForge's regenerated-data shape plus our metadata.

    {"id", "conversations": [prompt turns..., {"role": "assistant", "content",
     "reasoning_content"}], "status", "metadata": {...}, "token_ids"?: {"prompt", "response"}}

`status` is "success" only for a generation that ended by itself; a truncated one says
"truncated" (finish_reason "length"), so it is never trained on as a finished answer by mistake.

Its thinking mode is three facts, all recorded: `enable_thinking` (the job's, sent with the
request), and what the server decided: `chat_template` (the fingerprint of the template that
rendered the prompt) and `reasoning_parser` (what split the reasoning from the answer). The
training gate refuses to mix rows that differ in any of them (training/data/thinking.py).
"""
from __future__ import annotations

import time

from dflash_tasks.core.jobs import GenerationParams
from dflash_tasks.core.keys import GpuName
from dflash_tasks.sglang import Completion, ServerContract


def status_for(finish_reason: str) -> str:
    return {"stop": "success", "length": "truncated"}.get(finish_reason, finish_reason)


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
    return row
