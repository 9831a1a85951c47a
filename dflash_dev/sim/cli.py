"""`sim-server`: run the simulated SGLang server (`python -m dflash_dev.sim --port P`)."""
from __future__ import annotations

import click

from dflash_dev.sim import lengths
from dflash_dev.sim.server import SimConfig, run

_PROBABILITY = click.FloatRange(0.0, 1.0)
_POSITIVE = click.FloatRange(min=0.0, min_open=True)


@click.command("sim-server")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, required=True, help="Port to listen on.")
@click.option("--slots", type=click.IntRange(min=1), default=40, show_default=True,
              help="Decode slots, like SGLang's --max-running-requests.")
@click.option("--max-queued", type=click.IntRange(min=0), default=0, show_default=True,
              help='Waiting requests beyond which a request gets 503 "The request queue is full." (0: no limit).')
@click.option("--decode-tps", type=_POSITIVE, default=2000.0, show_default=True,
              help="Decode tokens per second of one request.")
@click.option("--prefill-tps", type=_POSITIVE, default=200000.0, show_default=True,
              help="Prompt tokens per second of prefill.")
@click.option("--model-name", default="Qwen/Qwen3-8B", show_default=True, help="The served model name.")
@click.option("--context-length", type=click.IntRange(min=2), default=40960, show_default=True,
              help="The model's context: a prompt plus max_tokens beyond it is refused (400).")
@click.option("--median-tokens", type=_POSITIVE, default=1800.0, show_default=True,
              help="Median natural output length.")
@click.option("--p-over-4096", type=click.FloatRange(0.0, 1.0, min_open=True, max_open=True), default=0.18,
              show_default=True, help="Share of natural outputs longer than 4096 tokens.")
@click.option("--loop-share", type=_PROBABILITY, default=0.0, show_default=True,
              help="Share of prompts whose output falls into a loop (a stretch of its reasoning "
                   "repeated) and runs to any cap.")
@click.option("--fixed-tokens", type=click.IntRange(min=0), default=0, show_default=True,
              help="If > 0, every natural output is exactly this long.")
@click.option("--sampling", type=click.Choice(["fixed", "random"]), default="fixed", show_default=True,
              help="fixed: every request for a prompt gets its one output, so a benchmark can compute "
                   "every length in advance; random: a request at a temperature above 0 draws one of "
                   "the prompt's outputs (each its own length and words), as samples do.")
@click.option("--startup-seconds", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              help="/health answers 503 for this long after start.")
@click.option("--fail-503", type=_PROBABILITY, default=0.0, show_default=True,
              help="Probability a generation request gets a 503.")
@click.option("--reset-rate", type=_PROBABILITY, default=0.0, show_default=True,
              help="Probability a generation request's connection is reset without a response.")
@click.option("--hang-rate", type=_PROBABILITY, default=0.0, show_default=True,
              help="Probability a generation request gets no answer for --hang-seconds.")
@click.option("--hang-seconds", type=click.FloatRange(min=0.0), default=3600.0, show_default=True,
              help="How long a hung request stays unanswered.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the fault draws.")
@click.option("--slow-factor", type=_POSITIVE, default=1.0, show_default=True,
              help="Multiplies every service time (a slower GPU).")
@click.option("--reasoning-parser", default="qwen3", show_default=True,
              help='SGLang\'s --reasoning-parser; "none": off (the reasoning stays in content).')
@click.option("--chat-template", default=None,
              help="SGLang's --chat-template, as /server_info reports it (the rendering stays Qwen3's).")
@click.option("--tokenizer", type=click.Choice(["words", "bytes"]), default="words", show_default=True,
              help="words: one `w<id>` word per token; bytes: a byte-level tokenizer whose characters "
                   "span several tokens (Chinese, emoji), as Qwen's BPE splits them.")
@click.option("--generation-config", "generation_config", metavar="NAME=VALUE,...", default=None,
              help="The model's generation_config.json sampling defaults (repetition_penalty=1.05,"
                   "min_p=0.05): the chat endpoint fills them into a request that leaves them unset, "
                   "/generate does not (SGLang's --sampling-defaults model).")
def sim_server(**options) -> None:
    """Serve SGLang 0.5.23's HTTP API from a simulated GPU: fixed decode slots, deterministic
    output lengths, injectable faults. Control endpoints: /sim/stats, /sim/faults, /sim/down, /sim/hold, /sim/release,
    /sim/sampling."""
    try:
        lengths.sigma_for(options["median_tokens"], options["p_over_4096"])
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--median-tokens/--p-over-4096") from None
    if options["fail_503"] + options["reset_rate"] + options["hang_rate"] > 1.0:
        raise click.BadParameter("the fault probabilities add up to more than 1",
                                 param_hint="--fail-503/--reset-rate/--hang-rate")
    if options["reasoning_parser"] == "none":
        options["reasoning_parser"] = None
    options["generation_config"] = _defaults(options["generation_config"])
    run(SimConfig(**options))


def _defaults(spec: str | None) -> dict | None:
    if not spec:
        return None
    known = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    out: dict = {}
    for item in spec.split(","):
        name, _, value = item.partition("=")
        if name.strip() not in known:
            raise click.BadParameter(f"{name.strip()!r} is not one of {', '.join(known)}",
                                     param_hint="--generation-config")
        try:
            out[name.strip()] = int(value) if name.strip() == "top_k" else float(value)
        except ValueError:
            raise click.BadParameter(f"{item!r}: {value!r} is not a number",
                                     param_hint="--generation-config") from None
    return out
