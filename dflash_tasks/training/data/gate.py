"""The quality gate: what a training row must be, and the figures that tell a good dataset from
a worthless one before anyone trains on it.

Per row (`check_row`), the known ways drafter data goes wrong, each a flag:

- `looping`: the output ends in a repetition loop (`metadata.loop`, output/loops.py): a drafter
  trained on it learns the loop (kept only on request, whatever its finish reason);
- `truncated`: finish_reason "length"; the answer never finished (kept only on request);
- `status_other`: any other non-success status (an aborted generation, say);
- `empty_answer`: a successful row whose `content` is empty or blank;
- `empty_reasoning`: a successful thinking-mode row whose `reasoning_content` is empty;
- `marker_in_content` / `marker_in_reasoning`: `<think>` or `</think>` leaked into the text
  (a reasoning parser that was off, or a template that re-inserted a think block);
- `short`: fewer loss tokens than `min_loss_tokens` (the "6 tokens" failure);
- `over_length`: more input ids than the training max length: trained on its first max_length
  tokens, as SpecForge trains such a row (`Rules.long_rows` "cut", the default; the report counts
  the rows cut and the tokens that left out), or dropped ("drop");
- `untokenized`: no server ids and no tokenizer to render it (tokenized formats only).

Over a dataset (`Report`), the distribution of loss-mask sums with its most common value (a
spike at one value is the signature of near-empty responses), the shares of each flag, the
rows the rules keep, and the rows' thinking modes (thinking.py: one mode per run).
`Thresholds.failures` turns the report into the list of crossed limits; `manage.py validate`
exits non-zero when it is not empty.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Iterable

from dflash_tasks.ingest.prompts import question_id
from dflash_tasks.ledger.histogram import nearest_rank
from dflash_tasks.training.data.thinking import ModeCensus
from dflash_tasks.training.data.tokens import Tokenized, is_truncated, row_thinking

THINK_MARKERS = ("<think>", "</think>")

# The order in which a dropped row is given its reason (the first flag that applies).
DROP_ORDER = ("duplicate", "status_other", "looping", "truncated", "marker_in_content",
              "marker_in_reasoning", "empty_answer", "empty_reasoning", "untokenized",
              "over_length", "short")

REASONS = {
    "duplicate": "an older copy of an id that a newer row replaced",
    "status_other": "status neither success nor truncated (aborted or failed generation)",
    "looping": "ends in a repetition loop (metadata.loop): training on it teaches the loop",
    "truncated": "truncated by max_tokens (finish_reason length): the answer never finished",
    "marker_in_content": "<think> or </think> inside content",
    "marker_in_reasoning": "<think> or </think> inside reasoning_content",
    "empty_answer": "empty answer (content) in a successful row",
    "empty_reasoning": "empty reasoning_content in a successful thinking-mode row",
    "untokenized": "no server token ids and no tokenizer to render the row",
    "over_length": "longer than the training max length (long_rows = \"drop\")",
    "short": "fewer loss tokens than the minimum",
}

LOSS_BUCKETS = (0, 1, 8, 32, 128, 512, 2048, 8192)  # lower edges, for the printed distribution
LONG_ROWS = ("cut", "drop")  # what becomes of a row longer than max_length


@dataclass(frozen=True)
class Rules:
    """What a row must be to be trained on: the gate's, the export's and the trainers' filter. A
    training run reads its rules from one place, its config's [rules] (queue/spec.run_rules)."""
    min_loss_tokens: int = 32
    # None: every row whole (none is longer than the job's cap plus its longest prompt)
    max_length: int | None = None
    keep_truncated: bool = False
    keep_looping: bool = False
    require_tokens: bool = True  # an untokenizable row is dropped (not for conversations)
    # a row longer than max_length: "cut" to its first max_length tokens, or "drop"
    long_rows: str = "cut"

    def __post_init__(self) -> None:
        if self.long_rows not in LONG_ROWS:
            raise ValueError(f"long_rows: {self.long_rows!r} is not one of {', '.join(LONG_ROWS)}")

    def drop_reason(self, flags: set[str]) -> str | None:
        for reason in DROP_ORDER:
            if reason in flags and not (reason == "truncated" and self.keep_truncated) \
                    and not (reason == "looping" and self.keep_looping) \
                    and not (reason == "untokenized" and not self.require_tokens) \
                    and not (reason == "over_length" and self.long_rows == "cut"):
                return reason
        return None

    def trained(self, tok: Tokenized | None) -> Tokenized | None:
        """The tokens a kept row is trained on: a row over max_length cut to its first
        max_length under long_rows "cut", else the row's own."""
        if tok is None or self.max_length is None or len(tok) <= self.max_length \
                or self.long_rows != "cut":
            return tok
        return tok.cut(self.max_length)


class HeldOut:
    """An evaluation's held-out prompts (ingest Prompts), looked for among a job's rows: the
    same turns but the assistant's (ingest.prompts.question_id), whatever the ids. The gate of
    a queued run with [eval] and train-eval --run both refuse what it finds."""

    def __init__(self, prompts: Iterable = ()):
        self.questions = {question_id(p.messages): p.id for p in prompts}
        self.found: dict[str, str] = {}  # held-out prompt id -> the first row that has it

    def see(self, row: dict) -> None:
        if self.questions and (held := self.questions.get(
                question_id(row.get("conversations") or []))):
            self.found.setdefault(held, str(row.get("id")))

    def named(self, first: int = 3) -> str:
        return ", ".join(f"{held} (row {row})" for held, row in list(self.found.items())[:first])


@dataclass
class RowCheck:
    id: str
    status: str
    thinking: bool
    loss_tokens: int | None
    length: int | None
    flags: set[str] = field(default_factory=set)
    cut_tokens: int = 0  # what cutting it to max_length leaves out (long_rows "cut")


def text_flags(row: dict) -> set[str]:
    """The flags that need no tokens: status, empty parts, leaked markers."""
    flags: set[str] = set()
    answer = (row.get("conversations") or [{}])[-1]
    content = answer.get("content") or ""
    reasoning = answer.get("reasoning_content") or ""
    status = row.get("status")
    if (row.get("metadata") or {}).get("loop"):
        flags.add("looping")
    if is_truncated(row):
        flags.add("truncated")
    elif status != "success":
        flags.add("status_other")
    if any(m in content for m in THINK_MARKERS):
        flags.add("marker_in_content")
    if any(m in reasoning for m in THINK_MARKERS):
        flags.add("marker_in_reasoning")
    if status == "success":
        if not content.strip():
            flags.add("empty_answer")
        if row_thinking(row) and not reasoning.strip():
            flags.add("empty_reasoning")
    return flags


def check_row(row: dict, tok: Tokenized | None, rules: Rules) -> RowCheck:
    flags = text_flags(row)
    if tok is None:
        flags.add("untokenized")
    else:
        trained = rules.trained(tok)  # a long row's loss tokens are those it keeps once cut
        if trained.loss_tokens < rules.min_loss_tokens:
            flags.add("short")
        if rules.max_length is not None and len(tok) > rules.max_length:
            flags.add("over_length")
    return RowCheck(str(row.get("id")), str(row.get("status")), row_thinking(row),
                    tok.loss_tokens if tok else None, len(tok) if tok else None, flags,
                    len(tok) - len(trained) if tok else 0)


def _length(max_length: int | None) -> str:
    return "none" if max_length is None else f"{max_length:,}"


def _pct(part: int, whole: int) -> float:
    return round(100 * part / whole, 2) if whole else 0.0


@dataclass
class Report:
    """Figures over a job's rows (the newest copy of each id)."""
    rules: Rules
    rows: int = 0
    duplicates: int = 0
    statuses: Counter = field(default_factory=Counter)
    flags: Counter = field(default_factory=Counter)
    thinking_success: int = 0
    success: int = 0
    loss_all: Counter = field(default_factory=Counter)      # loss-mask sum -> rows
    loss_finished: Counter = field(default_factory=Counter)  # the same, truncated rows left out
    sources: Counter = field(default_factory=Counter)       # "server" / "template"
    max_len: int = 0
    dropped: Counter = field(default_factory=Counter)       # first drop reason -> rows
    cut_rows: int = 0       # kept rows longer than max_length, trained on their first max_length
    cut_tokens: int = 0     # the tokens cutting them left out
    # with a tokenizer, both paths on rows that have server ids
    compared: int = 0
    prompt_mismatch: int = 0
    response_mismatch: int = 0
    mismatch_examples: list = field(default_factory=list)
    tokenize_errors: list = field(default_factory=list)
    modes: ModeCensus = field(default_factory=ModeCensus)
    heldout: HeldOut = field(default_factory=HeldOut)  # an evaluation's, found among the rows

    def add(self, check: RowCheck, tok: Tokenized | None = None) -> str | None:
        """Count one row; returns its drop reason under the rules (None: kept)."""
        self.rows += 1
        self.statuses[check.status] += 1
        self.flags.update(check.flags)
        if check.status == "success":
            self.success += 1
            self.thinking_success += check.thinking
        if check.loss_tokens is not None:
            self.loss_all[check.loss_tokens] += 1
            if "truncated" not in check.flags:
                self.loss_finished[check.loss_tokens] += 1
            self.max_len = max(self.max_len, check.length or 0)
        if tok is not None:
            self.sources[tok.source] += 1
        reason = self.rules.drop_reason(check.flags)
        if reason:
            self.dropped[reason] += 1
        elif check.cut_tokens:
            self.cut_rows += 1
            self.cut_tokens += check.cut_tokens
        return reason

    def kept(self) -> int:
        return self.rows - sum(v for k, v in self.dropped.items() if k != "duplicate")

    def add_duplicate(self) -> None:
        self.duplicates += 1
        self.dropped["duplicate"] += 1

    # -- figures ---------------------------------------------------------------------------------

    def spike(self) -> tuple[int | None, int, int]:
        """(the most common loss-mask sum among finished rows, its rows, finished rows)."""
        n = sum(self.loss_finished.values())
        if not n:
            return None, 0, 0
        value, count = self.loss_finished.most_common(1)[0]
        return value, count, n

    def distribution(self) -> list[dict]:
        out = []
        n = sum(self.loss_all.values())
        edges = list(LOSS_BUCKETS) + [None]
        for lo, hi in zip(edges, edges[1:]):
            count = sum(c for v, c in self.loss_all.items() if v >= lo and (hi is None or v < hi))
            label = f"{lo}" if hi == lo + 1 else (f"{lo}+" if hi is None else f"{lo}-{hi - 1}")
            out.append({"loss_tokens": label, "rows": count, "pct": _pct(count, n)})
        return out

    def figures(self) -> dict:
        tokenized = sum(self.loss_all.values())
        value, count, finished = self.spike()
        return {
            "rows": self.rows,
            "duplicates": self.duplicates,
            "statuses": dict(self.statuses),
            "tokenized_rows": tokenized,
            "token_sources": dict(self.sources),
            "loss_tokens": {
                "min": min(self.loss_all) if self.loss_all else None,
                "p10": nearest_rank(self.loss_all, 0.10), "p50": nearest_rank(self.loss_all, 0.50),
                "p90": nearest_rank(self.loss_all, 0.90), "max": max(self.loss_all) if self.loss_all else None,
                "most_common": value, "most_common_rows": count,
                "most_common_pct": _pct(count, finished),
                "distribution": self.distribution(),
            },
            "max_input_len": self.max_len,
            "short_pct": _pct(self.flags["short"], tokenized),
            "empty_answer_pct": _pct(self.flags["empty_answer"], self.success),
            "empty_reasoning_pct": _pct(self.flags["empty_reasoning"], self.thinking_success),
            "marker_in_content": self.flags["marker_in_content"],
            "marker_in_reasoning": self.flags["marker_in_reasoning"],
            "marker_pct": _pct(self.flags["marker_in_content"] + self.flags["marker_in_reasoning"],
                               self.rows),
            "truncated_pct": _pct(self.flags["truncated"], self.rows),
            "looping": self.flags["looping"],
            "looping_pct": _pct(self.flags["looping"], self.rows),
            "over_length": self.flags["over_length"],
            "over_length_pct": _pct(self.flags["over_length"], tokenized),
            "cut_rows": self.cut_rows,
            "cut_tokens": self.cut_tokens,
            "untokenized": self.flags["untokenized"],
            "template_check": ({"compared": self.compared, "prompt_mismatch": self.prompt_mismatch,
                                "response_mismatch": self.response_mismatch,
                                "examples": self.mismatch_examples[:5]}
                               if self.compared else None),
            "dropped": dict(self.dropped),
            "kept": self.kept(),
            "rules": asdict(self.rules),
            "thinking_mode": self.modes.figures(),
        }


@dataclass(frozen=True)
class Thresholds:
    """Limits whose crossing fails the gate (shares are fractions, 0.05 = 5%)."""
    max_spike_share: float = 0.10     # one loss-mask sum held by more than this share of rows
    spike_min_rows: int = 10          # ... and by at least this many (tiny samples repeat)
    max_short_share: float = 0.05
    max_empty_answer_share: float = 0.02
    max_empty_reasoning_share: float = 0.02
    max_marker_share: float = 0.001
    max_truncated_share: float = 0.30
    max_over_length_share: float = 0.05
    max_prompt_mismatch_share: float = 0.0
    min_rows: int = 1
    min_kept_rows: int = 1            # rows the rules keep: what the trainer will read

    def failures(self, report: Report) -> list[str]:
        f = report.figures()
        out: list[str] = []
        rules = report.rules
        if report.rows < self.min_rows:
            return [f"only {report.rows} rows (at least {self.min_rows} required): nothing to train on"]
        out.extend(report.modes.conflicts())
        if report.kept() < self.min_kept_rows:
            dropped = ", ".join(f"{k} {v:,}" for k, v in sorted(report.dropped.items())
                                if k != "duplicate") or "none"
            out.append(f"too few rows kept: the rules keep {report.kept():,} of {report.rows:,} "
                       f"rows (at least {self.min_kept_rows:,} needed); dropped: {dropped} "
                       f"(rules: min_loss_tokens {rules.min_loss_tokens}, max_length "
                       f"{_length(rules.max_length)}, keep_truncated "
                       f"{str(rules.keep_truncated).lower()})")
        tokenized = f["tokenized_rows"]
        if not tokenized:
            out.append("no row could be tokenized: the rows carry no server token ids "
                       "(return_token_ids) and no --tokenizer was given")
        value, count, finished = report.spike()
        if value is not None and count >= self.spike_min_rows and count > self.max_spike_share * finished:
            out.append(f"loss-mask spike: {_pct(count, finished)}% of finished rows ({count:,} of "
                       f"{finished:,}) have a loss mask of exactly {value} tokens (limit "
                       f"{100 * self.max_spike_share:g}%): near-empty or identical responses, "
                       "the \"6 tokens\" failure")
        if tokenized and report.flags["short"] > self.max_short_share * tokenized:
            out.append(f"short rows: {f['short_pct']}% ({report.flags['short']:,} of {tokenized:,}) "
                       f"have fewer than {rules.min_loss_tokens} loss tokens (limit "
                       f"{100 * self.max_short_share:g}%)")
        if report.flags["empty_answer"] > self.max_empty_answer_share * report.success:
            out.append(f"empty answers: {f['empty_answer_pct']}% of successful rows "
                       f"({report.flags['empty_answer']:,} of {report.success:,}) have an empty "
                       f"content (limit {100 * self.max_empty_answer_share:g}%)")
        if report.flags["empty_reasoning"] > self.max_empty_reasoning_share * report.thinking_success:
            out.append(f"empty reasoning: {f['empty_reasoning_pct']}% of successful thinking-mode "
                       f"rows ({report.flags['empty_reasoning']:,} of {report.thinking_success:,}) "
                       f"have no reasoning_content (limit {100 * self.max_empty_reasoning_share:g}%): "
                       "is the reasoning parser on (--reasoning-parser qwen3)?")
        markers = report.flags["marker_in_content"] + report.flags["marker_in_reasoning"]
        if markers > self.max_marker_share * report.rows:
            out.append(f"think markers leak: {markers:,} rows have <think> or </think> in content "
                       f"({report.flags['marker_in_content']:,}) or reasoning_content "
                       f"({report.flags['marker_in_reasoning']:,}) (limit "
                       f"{100 * self.max_marker_share:g}%)")
        if report.flags["truncated"] > self.max_truncated_share * report.rows:
            out.append(f"truncation: {f['truncated_pct']}% of rows ({report.flags['truncated']:,}) "
                       f"stopped at max_tokens (limit {100 * self.max_truncated_share:g}%): raise "
                       "max tokens (manage.py set --max-output-tokens)")
        # Rows lost to their length alone: a truncated row the rules drop anyway is counted
        # under truncation, not twice.
        too_long = report.dropped["over_length"]
        if tokenized and too_long > self.max_over_length_share * tokenized:
            out.append(f"too long: {_pct(too_long, tokenized)}% of rows ({too_long:,}) are "
                       f"dropped for exceeding the training max length {rules.max_length:,} "
                       f"(limit {100 * self.max_over_length_share:g}%): raise max_length, or "
                       "set long_rows = \"cut\" to train them on their first max_length tokens")
        if report.heldout.found:
            out.append(f"held-out prompts in the training job: {len(report.heldout.found):,} of "
                       f"the [eval] prompts are prompts of this job ({report.heldout.named()}): "
                       "the drafter trains on "
                       "the target's answers to them, and their tau would measure memorisation; "
                       "hold out others")
        if report.compared and report.prompt_mismatch > self.max_prompt_mismatch_share * report.compared:
            out.append(f"template mismatch: for {report.prompt_mismatch:,} of {report.compared:,} "
                       "rows the tokenizer's chat template renders a prompt other than the one "
                       "the server fed the model (an injected system prompt? a different think "
                       "block?): this tokenizer is not the server's")
        return out
