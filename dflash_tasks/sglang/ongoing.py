"""A generation in progress: one prompt's output as it goes on from its exact ids.

Four things carry a generation further than one request: the end game's rounds (a request cut at
its round's end), a move to a faster GPU (its request aborted there), a worker's warm stop, and
`regenerate --continue` (a row cut by the cap, after the cap was raised). Each ends in the same
value, an `Ongoing`: the prompt's ids, the response ids so far, the parameters it started with
and every GPU's share. It is stored as the prompt's entry (`entry`), read back by the next task
(`from_entry`), extended by one more request through SGLang's native /generate (`request`,
`went_on`), and, once it ends, made into the row one uninterrupted request gives (`finished`):

- the text is the server's decoding of all the response ids at once (/v1/detokenize), split into
  reasoning and answer as the chat endpoint splits it (reasoning.py), never texts of requests
  joined: a byte-level tokenizer splits characters across tokens, and a character cut in two by a
  request's end would be lost;
- the sampling parameters and thinking mode are those it started with (a `set` since applies
  to prompts not yet started; the cap alone is the job's at each request, from_entry), and every
  request, the first through the chat endpoint and the rest through /generate, sends them whole
  (GenerationParams.sampling), so both sample alike whatever the model's generation_config.json
  holds;
- each share is credited to the GPU that generated it, with the seconds it took there; the
  tokens kept from a truncated row are its prefix (`prefix_tokens`, the row's continued_tokens).

Sampling goes on from the same distribution: the ids so far are the input, and the server's
prefix cache serves them (DESIGN: "continuing from input_ids = prompt ids + partial ids").
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Sequence

from dflash_tasks.core import conversation
from dflash_tasks.core.jobs import GenerationParams
from dflash_tasks.sglang.client import Completion, Generation, SGLangClient
from dflash_tasks.sglang.reasoning import split_reasoning


@dataclass(frozen=True, slots=True)
class Share:
    """What one GPU generated of an output, in consecutive requests there, and in what time."""
    gpu: str
    tokens: int
    seconds: float = 0.0

    def stored(self) -> dict:
        return {"gpu": self.gpu, "tokens": self.tokens, "seconds": round(self.seconds, 3)}

    @classmethod
    def read(cls, data: dict) -> "Share":
        return cls(str(data["gpu"]), int(data["tokens"]), float(data.get("seconds") or 0.0))


@dataclass(frozen=True, slots=True)
class Part:
    """What one request added: its ids, why it ended, and how long it took."""
    ids: list[int]
    finish_reason: str
    latency_s: float
    matched_stop: object = None

    @classmethod
    def of(cls, answer: Completion | Generation) -> "Part":
        if isinstance(answer, Generation):
            return cls(answer.output_ids, answer.finish_reason, answer.latency_s,
                       answer.matched_stop)
        return cls(list(answer.response_token_ids or ()), answer.finish_reason, answer.latency_s,
                   answer.matched_stop)


@dataclass(frozen=True, slots=True)
class Ongoing:
    prompt_ids: list[int]
    response_ids: list[int]
    params: GenerationParams
    shares: tuple[Share, ...] = ()
    prefix_tokens: int = 0   # kept from a truncated row taken back (regenerate --continue)
    latency_s: float = 0.0   # the requests' time so far, on whichever GPUs
    retried: int = 0         # its requests that failed and were sent again, so far
    parts: int = 0           # requests whose output it holds
    # Set once it has ended (ended): its ids are whole, its text not yet decoded.
    finish_reason: str | None = None
    matched_stop: object = None

    # -- made, stored, read ------------------------------------------------------------------

    @classmethod
    def started(cls, first: Completion, params: GenerationParams) -> "Ongoing":
        """Before its first request's output: the prompt's ids, as the chat endpoint rendered
        them."""
        return cls(list(first.prompt_token_ids or ()), [], params)

    @classmethod
    def from_row(cls, row: dict, cap: int) -> "Ongoing":
        """A row cut by the cap, to go on up to `cap` (regenerate --continue): its ids are the
        prefix, its GPUs' shares stay theirs, and it goes on with its own sampling parameters
        (those it was generated with, whatever the job's are now): only the cap is new."""
        meta, ids = row["metadata"], row["token_ids"]
        own = {f.name: meta[f.name] for f in fields(GenerationParams) if f.name in meta}
        params = GenerationParams.from_dict({**own, "max_tokens": cap})
        shares = tuple(Share.read(s) for s in meta.get("gpus") or ())
        if (unnamed := len(ids["response"]) - sum(s.tokens for s in shares)) > 0:
            # one request's row, or one whose shares did not name its own prefix (older rows)
            shares = (Share(meta["gpu"], unnamed, 0.0 if shares else float(meta.get("latency_s")
                                                                            or 0)),) + shares
        return cls(list(ids["prompt"]), list(ids["response"]), params, shares,
                   prefix_tokens=len(ids["response"]), latency_s=float(meta.get("latency_s") or 0),
                   retried=max(0, int(meta.get("attempts") or 1) - 1), parts=1)

    def entry(self) -> dict:
        """As the prompt's entry keeps it (its "continue"), without any text: the text of a
        generation is decoded once, from all its ids, when it ends. Its parameters but the
        cap: the cap is the job's at each request (from_entry)."""
        params = asdict(self.params)
        del params["max_tokens"]
        return {"prompt_ids": self.prompt_ids, "response_ids": self.response_ids,
                "params": params,
                "gpus": [s.stored() for s in self.shares], "prefix_tokens": self.prefix_tokens,
                "latency_s": round(self.latency_s, 3), "retried": self.retried,
                "parts": self.parts,
                **({"finish_reason": self.finish_reason, "matched_stop": self.matched_stop}
                   if self.finish_reason is not None else {})}

    @classmethod
    def from_entry(cls, cont: dict, job_params: GenerationParams) -> "Ongoing":
        """An entry as `entry` wrote it: its own sampling parameters and thinking mode, and the
        job's cap now. The cap decides only where a generation ends, not how a token is sampled:
        raised, it lets every generation go further (`regenerate --continue`, a `retry-failed`
        after a prompt too long for the cap); lowered to what one has, that one starts over
        (generate.py's _ongoing). An entry written before the parameters were kept in it (a
        deployment upgraded mid-run) goes on with the job's."""
        stored = cont.get("params")
        params = GenerationParams.from_dict({"max_tokens": job_params.max_tokens, **stored}) \
            if stored else job_params
        shares = tuple(Share.read(s) for s in cont.get("gpus") or ())
        response = list(cont["response_ids"])
        made = sum(s.tokens for s in shares)
        prefix = int(cont["prefix_tokens"]) if "prefix_tokens" in cont else len(response) - made
        return cls(list(cont["prompt_ids"]), response, params, shares, prefix_tokens=prefix,
                   latency_s=float(cont.get("latency_s") or 0), retried=int(cont.get("retried") or 0),
                   parts=int(cont.get("parts") or (1 if response else 0)),
                   finish_reason=cont.get("finish_reason"), matched_stop=cont.get("matched_stop"))

    # -- going on ------------------------------------------------------------------------------

    @property
    def generated(self) -> int:
        return len(self.response_ids)

    @property
    def attempts(self) -> int:
        """The row's attempts, as one request's: 1, and one more per failed request of any of
        its parts (a round or a move is not an attempt)."""
        return self.retried + 1

    def request(self, client: SGLangClient, *, until: int, rid: str,
                seed: int | None = None) -> Generation:
        """One more request, through /generate, up to `until` tokens in all, with the prompt's
        seed (jobs.request_seed), as every part before it."""
        budget = until - self.generated
        if budget <= 0:
            raise ValueError(f"a cap of {until} leaves nothing to generate after "
                             f"{self.generated} tokens")
        return client.generate(self.prompt_ids + self.response_ids, max_new_tokens=budget,
                               sampling=self.params.sampling(), rid=rid, seed=seed)

    def went_on(self, part: Part, gpu: str, attempts: int) -> "Ongoing":
        """This generation with `part` added, made on `gpu` in `attempts` requests (the last the
        one that gave it, the others failed)."""
        return replace(self, response_ids=self.response_ids + list(part.ids),
                       shares=with_share(self.shares, gpu, len(part.ids), part.latency_s,
                                         after_prefix=self.generated == self.prefix_tokens),
                       latency_s=self.latency_s + part.latency_s,
                       retried=self.retried + attempts - 1, parts=self.parts + 1)

    # -- ended ---------------------------------------------------------------------------------

    def ended(self, last: Part) -> "Ongoing":
        """This generation, ended with its last part (`last`, already added by went_on)."""
        return replace(self, finish_reason=last.finish_reason, matched_stop=last.matched_stop)

    def cut_at(self, cap: int) -> "Ongoing":
        """This generation ended by a cap it has reached without a finish of its own: its first
        `cap` ids, each share kept up to them, finished "length", the row one request capped
        there gives (the first `cap` tokens of a longer sample are a sample capped at `cap`)."""
        shares, left = [], cap
        for share in self.shares:
            if left <= 0:
                break
            shares.append(replace(share, tokens=min(share.tokens, left)))
            left -= share.tokens
        return replace(self, response_ids=self.response_ids[:cap], shares=tuple(shares),
                       prefix_tokens=min(self.prefix_tokens, cap), finish_reason="length",
                       matched_stop=None)

    def finished(self, client: SGLangClient, *, reasoning_parser: str | None) -> Completion:
        """The whole ended generation as one request would have answered it: its text decoded
        from all its ids by the server, split as the chat endpoint splits it."""
        if self.finish_reason is None:
            raise ValueError("a generation that has not ended has no row")
        text = client.detokenize(self.response_ids) if self.response_ids else ""
        reasoning, content = split_reasoning(text, parser=reasoning_parser,
                                             enable_thinking=self.params.enable_thinking)
        return Completion(
            content=content, reasoning_content=reasoning, finish_reason=self.finish_reason,
            prompt_tokens=len(self.prompt_ids), completion_tokens=self.generated,
            reasoning_tokens=reasoning_tokens(self.response_ids, client.think_end_ids(),
                                              self.params.enable_thinking),
            model=client.served_model(), latency_s=self.latency_s,
            prompt_token_ids=self.prompt_ids, response_token_ids=self.response_ids,
            matched_stop=self.matched_stop, continued_tokens=self.prefix_tokens,
            worked=self.shares if self.parts > 1 or self.prefix_tokens else ())


def with_share(shares: Sequence[Share], gpu: str, tokens: int, seconds: float, *,
               after_prefix: bool = False) -> tuple[Share, ...]:
    """`shares` with `gpu`'s `tokens` added: to its last share when it made the last part too
    (rounds in a row on one GPU are one share), unless that share is a truncated row's prefix."""
    out = list(shares)
    if out and out[-1].gpu == gpu and not after_prefix:
        last = out[-1]
        out[-1] = Share(gpu, last.tokens + tokens, last.seconds + seconds)
    else:
        out.append(Share(gpu, tokens, seconds))
    return tuple(out)


def reasoning_tokens(ids: Sequence[int], think_end: Sequence[int], enable_thinking: bool) -> int:
    """SGLang's usage.reasoning_tokens: in thinking mode every token up to and including the end
    of the first `</think>`, all of them when it never came."""
    if not enable_thinking:
        return 0
    n = len(think_end)
    if n == 1:
        try:
            return list(ids).index(think_end[0]) + 1
        except ValueError:
            return len(ids)
    for i in range(len(ids) - n + 1):
        if tuple(ids[i:i + n]) == tuple(think_end):
            return i + n
    return len(ids)


def entry_from_row(row: dict, *, continue_output: bool, cap: int) -> dict:
    """The prompt entry that brings a finished row back (regenerate): its messages (a
    conversation's script: every reply made again, or with continue_output the one cut at the
    cap going on after the others, then the turns it left unanswered), and with
    continue_output, for a row cut by the cap whose token ids it kept, the generation that goes
    on from them with its own sampling parameters (`cap`: the job's now). A penalised row starts over instead: SGLang's penalties count
    only a request's own output, so going on would not sample as one request did."""
    script = conversation.script_of(row)
    if script is not None:  # a conversation (enqueue --turns all): its script again
        entry: dict = {"messages": script}
        last = conversation.reply_rows(row)[-1]  # its last reply, as a row of its own
    else:
        entry, last = {"messages": row["conversations"][:-1]}, row
    if continue_output and last.get("token_ids") and last["metadata"]["finish_reason"] == "length":
        ongoing = Ongoing.from_row(last, cap)
        if ongoing.params.continuable:
            entry["continue"] = ongoing.entry()
            if script is not None:  # its earlier replies stay; the last goes on
                entry["turns"] = conversation.turn_records(row)
    return entry
