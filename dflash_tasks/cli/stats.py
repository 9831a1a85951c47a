"""`stats`: output-length percentiles, finish reasons and truncation, in seconds at any scale."""
from __future__ import annotations

import json
from pathlib import Path

import click
from rich.table import Table

from dflash_tasks.cli.common import (
    console,
    file_to_write,
    job_option,
    job_or_fail,
    output_storage,
    redis_or_fail,
    storage_location,
)
from dflash_tasks.core.keys import JobName


def _row(t: Table, label: str, s: dict) -> None:
    t.add_row(label, *(f"{s[k]:,}" if isinstance(s[k], int) else f"{s[k]:,.1f}"
                       for k in ("p50", "p90", "p99", "max")))


@click.command()
@job_option
@click.option("--json", "as_json", is_flag=True, help="Everything, machine-readable.")
@click.option("--from", "source", metavar="DIR|s3://BUCKET/PREFIX",
              callback=storage_location, help="Where the job's batches are.",
              show_default="the location the job keeps")
@click.option("--sample", type=click.IntRange(min=0), default=2000, show_default=True,
              help="Newest rows read for what counters cannot tell (0: counters only).")
@click.option("--plot", metavar="FILE.png", callback=file_to_write(".png"),
              help="Write a PNG histogram of output lengths.")
def stats(name: JobName, as_json: bool, source: str | None, sample: int, plot: Path | None) -> None:
    """Output-token percentiles, finish reasons, truncation (while thinking or in the answer),
    reasoning against answer length, empty answers, think markers in content, per GPU."""
    from dflash_tasks.output.stats import counter_hist, job_stats, plot_lengths

    r = redis_or_fail()
    job = job_or_fail(r, name)
    result = job_stats(r, output_storage(source, name, r), name, max_tokens=job.params.max_tokens,
                       sample=sample, samples=job.samples, turns=job.turns)
    if plot:
        plot_lengths(counter_hist(r, name), job.params.max_tokens, plot)
    if as_json:
        click.echo(json.dumps(result, indent=1))
        return
    s = result["sample"]
    t = Table("output tokens", "p50", "p90", "p99", "max",
              title=f"job {name}: {result['completed']:,} completions, max_tokens {job.params.max_tokens:,}")
    _row(t, "all rows (64-token buckets)", result["output_tokens"])
    if s["rows"]:
        for key in ("output_tokens", "reasoning_tokens", "answer_tokens", "prompt_tokens"):
            _row(t, f"{key.replace('_', ' ')} (sample of {s['rows']:,})", s[key])
        for gpu, g in s["per_gpu"].items():
            _row(t, f"{gpu} output tokens (sample)", g)
    console.print(t)
    reasons = ", ".join(f"{k} {v:,} ({100 * v / max(1, result['completed']):.1f}%)"
                        for k, v in sorted(result["finish_reasons"].items()))
    console.print(f"finish reasons: {reasons}")
    console.print(f"truncated: {result['truncated_pct']:.1f}% of all rows"
                  + (f"; in the sample {s['truncated_thinking_pct']:.1f}% while thinking (no answer), "
                     f"{s['truncated_answer_pct']:.1f}% in the answer" if s["rows"] else ""))
    split = result["truncated"]
    if split["rows"] and not split["looping"]:
        console.print(f"truncated rows: none looping, all {split['rows']:,} still progressing (a "
                      "higher cap may let them finish)")
    elif split["rows"]:
        console.print(
            f"truncated rows: {split['looping']:,} looping "
            f"({100 * split['looping'] / split['rows']:.1f}%, {split['looping_mean_tokens']:,} "
            f"tokens on average: a higher cap buys more of the loop), {split['progressing']:,} "
            "still progressing (a higher cap may let them finish)"
            + (f"; loop periods in the sample: p50 {s['loop_periods']['p50']:,}, max "
               f"{s['loop_periods']['max']:,} tokens" if s["loop_periods"]["count"] else ""))
    if s["rows"]:
        console.print(f"sample: {s['empty_answers']:,} empty answers, {s['empty_reasoning']:,} empty "
                      f"reasoning, {s['think_markers_in_content']:,} think markers in content")
    per = result["rows_per_prompt"]
    if per["samples"] > 1:
        console.print(f"rows per prompt: {per['samples']} samples asked, {per['mean']:.2f} made on "
                      f"average over {per['prompts']:,} prompts"
                      + (f"; in the sample {s['repeated_samples']:,} rows repeat another sample of "
                         "their prompt" if s["rows"] else ""))
    if (turns := result["turns"]) is not None:
        console.print(f"conversations: {turns['conversations']:,} done, {turns['replies']:,} "
                      f"replies ({turns['mean_replies']:.2f} each); {turns['ended_by_length']:,} "
                      "ended early by a reply cut at the cap")
    if plot:
        console.print(f"histogram written to {plot}")
