"""Continuing a truncated generation instead of starting over.

A row cut by the cap already holds its first max_tokens tokens. SGLang's native /generate takes
the prompt's ids followed by those output ids and samples the rest from the same distribution;
its prefix cache serves the known part, so only the new tokens cost decode time. At the real run's
figures (18% of 904,286 prompts cut at 4,096, raised to 8,192) that is about 660 million tokens
not generated twice.
"""
from __future__ import annotations

from typing import Sequence

from dflash_tasks.core.jobs import GenerationParams
from dflash_tasks.core.keys import GpuName
from dflash_tasks.sglang import Completion, Generation, RequestAborted, SGLangClient

THINK_END = "</think>"
QWEN3_THINK_END_ID = 151668


def entry_from_row(row: dict, *, continue_output: bool) -> dict:
    """The prompt entry that brings a finished row back: its messages, and with continue_output
    (and the server's ids in the row) what the continuation needs."""
    entry: dict = {"messages": row["conversations"][:-1]}
    ids = row.get("token_ids")
    if continue_output and ids and row["metadata"]["finish_reason"] == "length":
        answer = row["conversations"][-1]
        meta = row["metadata"]
        entry["continue"] = {
            "prompt_ids": ids["prompt"], "response_ids": ids["response"],
            "content": answer.get("content") or "",
            "reasoning_content": answer.get("reasoning_content"),
            "reasoning_tokens": meta.get("reasoning_tokens", 0),
            "enable_thinking": meta.get("enable_thinking", True),
        }
    return entry


def continue_generation(client: SGLangClient, cont: dict, params: GenerationParams,
                        rid: str, *, until: int | None = None) -> Completion:
    """Generate the rest of a truncated (or moved, or cut at a round's end: generate.py) output
    up to `until` tokens in all (params.max_tokens by default), and return the whole completion
    as if it had been generated in one request. Aborted on the server, it raises RequestAborted
    whose partial is the whole so far, in the same form."""
    old_ids = cont["response_ids"]
    cap = params.max_tokens if until is None else until
    budget = cap - len(old_ids)
    if budget <= 0:
        raise ValueError(f"max_tokens {cap} leaves nothing to continue after "
                         f"{len(old_ids)} tokens")
    try:
        g = client.generate(cont["prompt_ids"] + old_ids, max_new_tokens=budget,
                            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                            rid=rid)
    except RequestAborted as exc:
        if isinstance(exc.partial, Generation):
            exc.partial = _joined(client, cont, exc.partial)
        raise
    return _joined(client, cont, g)


def _joined(client: SGLangClient, cont: dict, g: Generation) -> Completion:
    """The output so far (`cont`) followed by what /generate added (`g`), as one completion."""
    old_ids = cont["response_ids"]
    reasoning, content = cont["reasoning_content"], cont["content"]
    reasoning_tokens = int(cont.get("reasoning_tokens") or 0)
    if cont.get("enable_thinking") and not content:  # the cap struck while it was still thinking
        head, found, tail = g.text.partition(THINK_END)
        reasoning = (reasoning or "") + head
        if found:
            reasoning, content = reasoning.rstrip(), tail.lstrip()
            reasoning_tokens += (g.output_ids.index(QWEN3_THINK_END_ID) + 1
                                 if QWEN3_THINK_END_ID in g.output_ids else len(g.output_ids))
        else:
            reasoning_tokens += len(g.output_ids)
    else:
        content = content + g.text
    return Completion(
        content=content, reasoning_content=reasoning, finish_reason=g.finish_reason,
        prompt_tokens=len(cont["prompt_ids"]), completion_tokens=len(old_ids) + g.completion_tokens,
        reasoning_tokens=reasoning_tokens, model=client.served_model(), latency_s=g.latency_s,
        prompt_token_ids=cont["prompt_ids"], response_token_ids=old_ids + g.output_ids,
        matched_stop=g.matched_stop, continued_tokens=len(old_ids),
        worked=tuple(cont.get("gpus") or ()))


def with_share(worked: Sequence[dict], gpu: GpuName, tokens: int) -> list[dict]:
    """The GPUs that worked on an output, in order, with `gpu`'s share of `tokens` added (to its
    entry when it made the last part too: rounds in a row on one GPU are one share)."""
    out = [dict(w) for w in worked]
    if out and out[-1]["gpu"] == gpu:
        out[-1]["tokens"] += tokens
    else:
        out.append({"gpu": gpu, "tokens": tokens})
    return out


def entry_from_partial(messages: list[dict], partial: Completion, gpu: GpuName,
                       enable_thinking: bool, body_reference: bytes | None = None) -> dict:
    """The prompt entry that takes a generation stopped on `gpu` (aborted to move it, or cut at
    the end of a round) further: what it had generated there (its exact ids, its texts) to go
    on from, and which GPUs made how much (one entry for rounds in a row on the same GPU). A
    prompt whose text is kept on storage keeps its reference, for the index of rows by finish
    reason (ledger/bodies.py)."""
    entry = {"messages": messages, "continue": {
        "prompt_ids": partial.prompt_token_ids, "response_ids": partial.response_token_ids,
        "content": partial.content, "reasoning_content": partial.reasoning_content,
        "reasoning_tokens": partial.reasoning_tokens, "enable_thinking": enable_thinking,
        "gpus": with_share(partial.worked, gpu,
                           partial.completion_tokens - partial.continued_tokens)}}
    if body_reference is not None:
        entry["reference"] = body_reference.decode()
    return entry
