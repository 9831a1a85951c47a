"""`manage.py validate`: the quality gate over a job's shipped rows."""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import click
from rich.table import Table

from dflash_tasks.cli.common import (
    JOB,
    chat_template_option,
    console,
    err_console,
    job_storage_from,
    rule_options,
    shipped_progress,
    storage_location,
)
from dflash_tasks.core.keys import JobName

_SHARE = click.FloatRange(0.0, 1.0)


def _gate_default(limit: str) -> str:
    from dflash_tasks.training.data.gate import Thresholds

    return f"[gate] {limit}, else {getattr(Thresholds(), limit):g}"


def _print_report(name: str, where: str, figures: dict, failures: list[str], state: dict | None,
                  th) -> None:
    lt = figures["loss_tokens"]
    t = Table(title=f"quality gate of job {name}", show_header=False, box=None)
    t.add_row("manifest", where)
    if state:
        t.add_row("job", f"{state.get('status')}, {state.get('completed', 0):,} completed"
                  + ("" if state.get("status") == "done" else " (still generating: this checks "
                                                              "what is shipped so far)"))
    t.add_row("rows", f"{figures['rows']:,} unique ids ({figures['duplicates']:,} older "
                      "duplicates replaced by newer rows)")
    t.add_row("statuses", ", ".join(f"{k} {v:,}" for k, v in sorted(figures["statuses"].items())))
    sources = ", ".join(f"{k} {v:,}" for k, v in sorted(figures["token_sources"].items())) or "none"
    t.add_row("tokens from", f"{sources}; untokenized {figures['untokenized']:,}")
    if lt["p50"] is not None:
        t.add_row("loss tokens", f"min {lt['min']:,}  p10 {lt['p10']:,}  p50 {lt['p50']:,}  "
                                 f"p90 {lt['p90']:,}  max {lt['max']:,}")
    if lt["most_common"] is not None:  # None when no row finished (all truncated)
        t.add_row("most common", f"{lt['most_common']:,} tokens in {lt['most_common_pct']}% of "
                                 f"finished rows ({lt['most_common_rows']:,}; limit "
                                 f"{100 * th.max_spike_share:g}%)")
    t.add_row("short", f"{figures['short_pct']}% under {figures['rules']['min_loss_tokens']} loss "
                       f"tokens (limit {100 * th.max_short_share:g}%)")
    t.add_row("empty answers", f"{figures['empty_answer_pct']}% of successful rows "
                               f"(limit {100 * th.max_empty_answer_share:g}%)")
    t.add_row("empty reasoning", f"{figures['empty_reasoning_pct']}% of successful thinking rows "
                                 f"(limit {100 * th.max_empty_reasoning_share:g}%)")
    t.add_row("think markers", f"{figures['marker_in_content']:,} in content, "
                               f"{figures['marker_in_reasoning']:,} in reasoning "
                               f"(limit {100 * th.max_marker_share:g}%)")
    t.add_row("truncated", f"{figures['truncated_pct']}% (limit {100 * th.max_truncated_share:g}%)")
    t.add_row("looping", f"{figures['looping']:,} rows end in a repetition loop "
                         f"({figures['looping_pct']}%; "
                         + ("kept" if figures["rules"]["keep_looping"] else "dropped") + ")")
    if figures["rules"]["max_length"] is None:
        t.add_row("max length", f"none: every row whole (the longest {figures['max_input_len']:,}"
                                " tokens)")
    elif figures["rules"]["long_rows"] == "cut":
        t.add_row("over max length", f"{figures['over_length']:,} rows over "
                                     f"{figures['rules']['max_length']:,} (longest "
                                     f"{figures['max_input_len']:,}): {figures['cut_rows']:,} "
                                     f"kept are cut to it, {figures['cut_tokens']:,} tokens "
                                     "left out")
    else:
        t.add_row("over max length", f"{figures['over_length']:,} rows over "
                                     f"{figures['rules']['max_length']:,} (longest "
                                     f"{figures['max_input_len']:,}), dropped; limit "
                                     f"{100 * th.max_over_length_share:g}%")
    tc = figures["template_check"]
    if tc:
        t.add_row("template check", f"{tc['compared']:,} rows rendered by --tokenizer: prompt "
                                    f"differs in {tc['prompt_mismatch']:,}, tokens or mask in "
                                    f"{tc['response_mismatch']:,}")
    mode = figures["thinking_mode"]
    t.add_row("thinking mode", ", ".join(
        f"{f} " + (" / ".join(f"{v} ({n:,})" for v, n in mode["values"][f].items()) or "not recorded")
        for f in ("enable_thinking", "chat_template", "reasoning_parser")))
    if mode["unrecorded_rows"]:
        t.add_row("", "[yellow]kept rows without a record (older rows, accepted): "
                  + ", ".join(f"{f} {n:,}" for f, n in sorted(mode["unrecorded_rows"].items())) + "[/]")
    dropped = figures["dropped"]
    t.add_row("export keeps", f"{figures['kept']:,} rows; drops "
              + (", ".join(f"{k} {v:,}" for k, v in sorted(dropped.items())) or "none"))
    console.print(t)
    d = Table(title="loss-mask sums (tokens trained on per row)", box=None)
    d.add_column("loss tokens", justify="right")
    d.add_column("rows", justify="right")
    d.add_column("%", justify="right")
    d.add_column("")
    peak = max((b["pct"] for b in lt["distribution"]), default=0) or 1
    for b in lt["distribution"]:
        d.add_row(b["loss_tokens"], f"{b['rows']:,}", f"{b['pct']:.1f}",
                  "█" * round(30 * b["pct"] / peak))
    console.print(d)
    if failures:
        console.print(f"[bold red]FAIL[/]: {len(failures)} threshold(s) crossed")
    else:
        console.print("[bold green]PASS[/]: every threshold holds")


def _the_gate(config: Path | None, trainer: str, rules: dict, limits: dict):
    """The rules and limits the training run's gate applies with this config (or without one),
    with those an option sets instead, said on stderr: the run would not apply them."""
    from dflash_tasks.training.queue.spec import SpecError, read_config, run_gate

    try:
        gate_rules, gate_limits = run_gate(read_config(config), trainer, str(config or "--config"))
    except SpecError as exc:
        raise click.BadParameter(str(exc), param_hint="--config") from None
    rules = {k: v for k, v in rules.items() if v is not None}
    limits = {k: v for k, v in limits.items() if v is not None}
    gate = {**asdict(gate_limits), **asdict(gate_rules)}
    changed = [f"--{k.replace('_', '-')} {v} (the training gate's: {gate[k]})"
               for k, v in {**rules, **limits}.items() if v != gate[k]]
    if changed:
        err_console.print("validate: not the training gate: " + ", ".join(changed),
                          highlight=False)
    return replace(gate_rules, **rules), replace(gate_limits, **limits)


@click.command()
@click.option("--job", "name", type=JOB, required=True, help="The job whose shipped rows to check.")
@click.option("--from", "source", metavar="S3_URI_OR_DIR", callback=storage_location,
              help="Where the batches are.", show_default="the location the job keeps")
@click.option("--config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The training config (`train --config`): its [rules] and [gate] are the "
                   "check, as the training run applies it.", show_default="train's defaults")
@click.option("--trainer", type=click.Choice(["reference", "command"]), default="reference",
              show_default=True, help="The trainer whose defaults fill the rules (as `train`).")
@rule_options(from_config=True)
@click.option("--sample", type=click.IntRange(min=0), default=0, show_default=True,
              help="Check only the newest N rows (0: all).")
@click.option("--compare-rows", type=click.IntRange(min=0), default=1000, show_default=True,
              help="With --tokenizer: render this many rows that have server ids through the "
                   "template and compare.")
@click.option("--max-spike-share", type=_SHARE, default=None,
              show_default=_gate_default("max_spike_share"),
              help="Fail when one loss-mask sum holds more than this share of finished rows.")
@click.option("--max-short-share", type=_SHARE, default=None,
              show_default=_gate_default("max_short_share"),
              help="Fail when more rows than this have fewer than --min-loss-tokens.")
@click.option("--max-empty-answer-share", type=_SHARE, default=None,
              show_default=_gate_default("max_empty_answer_share"),
              help="Fail when more rows than this have an empty answer.")
@click.option("--max-empty-reasoning-share", type=_SHARE, default=None,
              show_default=_gate_default("max_empty_reasoning_share"),
              help="Fail when more rows than this have an empty reasoning (thinking mode).")
@click.option("--max-marker-share", type=_SHARE, default=None,
              show_default=_gate_default("max_marker_share"),
              help="Fail when more rows than this have think markers in their text.")
@click.option("--max-truncated-share", type=_SHARE, default=None,
              show_default=_gate_default("max_truncated_share"),
              help="Fail when more rows than this were cut by max_tokens.")
@click.option("--max-over-length-share", type=_SHARE, default=None,
              show_default=_gate_default("max_over_length_share"),
              help="Fail when more rows than this are longer than --max-length.")
@click.option("--max-prompt-mismatch-share", type=_SHARE, default=None,
              show_default=_gate_default("max_prompt_mismatch_share"),
              help="With --tokenizer: fail when its template renders other prompts than the "
                   "server's for more rows than this.")
@click.option("--min-kept-rows", type=click.IntRange(min=0), default=None,
              show_default=_gate_default("min_kept_rows"),
              help="Fail when the rules keep fewer rows than this (what the trainer would read).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def validate(name: JobName, source: str | None, config: Path | None, trainer: str,
             tokenizer: Path | None, min_loss_tokens: int | None, max_length: int | None,
             long_rows: str | None, keep_truncated: bool | None, keep_looping: bool | None, sample: int, compare_rows: int, as_json: bool,
             **limits) -> None:
    """The quality gate: check a job's shipped rows before training on them. Reports the
    loss-mask distribution (and a spike at one value), empty answers and reasoning, think
    markers in the text, truncation, duplicate ids and rows over the max length; exits 1 with
    the reasons when a threshold is crossed, so a training launch can depend on it. Its rules
    and limits are the training gate's (`train --config`), unless an option sets one."""
    from dflash_tasks.output.batches import ChecksumMismatch
    from dflash_tasks.output.storage import StorageError
    from dflash_tasks.training.data.exports import validate_job
    from dflash_tasks.training.data.reader import NoManifest

    rules, th = _the_gate(config, trainer, {"min_loss_tokens": min_loss_tokens,
                                            "max_length": max_length,
                                            "long_rows": long_rows,
                                            "keep_truncated": keep_truncated,
                                            "keep_looping": keep_looping}, limits)
    storage = job_storage_from(source, name)
    template = chat_template_option(tokenizer)
    try:
        with err_console.status(f"reading {storage.location(name + '/manifest.json')} ...") as spin:
            n = [0]

            def on_batch(rec: dict) -> None:
                n[0] += 1
                spin.update(f"checked {n[0]} batches ({rec['name']})")

            report, failures = validate_job(storage, name, rules, th, template=template,
                                            sample=sample or None, compare_rows=compare_rows,
                                            on_batch=on_batch)
    except (NoManifest, ChecksumMismatch, StorageError) as exc:
        raise click.ClickException(str(exc)) from None
    figures = report.figures()
    state = shipped_progress(storage, name)
    if as_json:
        click.echo(json.dumps({**figures, "job": name, "passed": not failures,
                               "failures": failures, "thresholds": th.__dict__,
                               "job_status": state.get("status") if state else None}, indent=1))
    else:
        _print_report(name, storage.location(f"{name}/manifest.json"), figures, failures, state, th)
    if failures:
        err_console.print(f"validate: job {name} FAILS the quality gate:\n"
                          + "\n".join(f"  - {f}" for f in failures), highlight=False)
        sys.exit(1)


