"""The baseline: how such a job is usually scripted. One asyncio process splits the prompts
round-robin over the servers up front and keeps at most `--slots` requests in flight per server
(a semaphore each), appending every answer to a JSONL file. No Celery, no Redis.

    python -m benchmarks.baseline --dataset D.jsonl --out rows.jsonl --slots 40 URL [URL ...]

It sends exactly the request the project's workers send (same model name, max_tokens, sampling,
thinking, separate_reasoning, return_token_ids) through one httpx.AsyncClient with keep-alive, and
retries a failed request a few times. Prints a JSON summary on stdout when done.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_tasks.core.jobs import GenerationParams  # noqa: E402
from dflash_tasks.ingest.prompts import read_prompts  # noqa: E402


async def run(urls: list[str], slots: int, dataset: Path, out: Path, params: GenerationParams) -> dict:
    prompts = list(read_prompts(dataset))
    limits = httpx.Limits(max_connections=len(urls) * slots + 8,
                          max_keepalive_connections=len(urls) * slots + 8, keepalive_expiry=4.0)
    dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
    failed = done = 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0, connect=10.0), limits=limits) as client:
        model = (await client.get(urls[0] + "/v1/models")).json()["data"][0]["id"]
        semaphores = [asyncio.Semaphore(slots) for _ in urls]
        with out.open("w", encoding="utf-8") as sink:

            async def one(i: int) -> None:
                nonlocal failed, done
                p = prompts[i]
                url, sem = urls[i % len(urls)], semaphores[i % len(urls)]
                body = {"model": model, "messages": list(p.messages), "max_tokens": params.max_tokens,
                        "temperature": params.temperature, "top_p": params.top_p,
                        "top_k": params.top_k,
                        "chat_template_kwargs": {"enable_thinking": params.enable_thinking},
                        "separate_reasoning": True, "return_token_ids": True, "stream": False}
                async with sem:
                    for attempt in range(1, 6):
                        started = time.monotonic()
                        try:
                            response = await client.post(url + "/v1/chat/completions", json=body)
                            response.raise_for_status()
                            data = response.json()
                            break
                        except httpx.HTTPError:
                            if attempt == 5:
                                failed += 1
                                return
                            await asyncio.sleep(1.0)
                choice, usage = data["choices"][0], data["usage"]
                message = choice["message"]
                sink.write(dumps({
                    "id": p.id,
                    "conversations": [*p.messages, {"role": "assistant", "content": message["content"],
                                                    "reasoning_content": message.get("reasoning_content")}],
                    "metadata": {"finish_reason": choice["finish_reason"],
                                 "prompt_tokens": usage["prompt_tokens"],
                                 "completion_tokens": usage["completion_tokens"],
                                 "latency_s": round(time.monotonic() - started, 3), "attempts": attempt},
                    "token_ids": {"prompt": choice.get("prompt_token_ids"),
                                  "response": choice.get("response_token_ids")},
                }))
                sink.write("\n")
                done += 1

            started = time.time()
            await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return {"prompts": len(prompts), "completed": done, "failed": failed,
            "started_at": started, "finished_at": time.time(), "cpu_s": time.process_time()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("urls", nargs="+")
    ap.add_argument("--dataset", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--slots", type=int, required=True, help="Requests in flight per server.")
    ap.add_argument("--max-tokens", type=int, default=GenerationParams().max_tokens)
    args = ap.parse_args()
    params = GenerationParams().replace(max_tokens=args.max_tokens)
    print(json.dumps(asyncio.run(run(args.urls, args.slots, args.dataset, args.out, params))))


if __name__ == "__main__":
    main()
