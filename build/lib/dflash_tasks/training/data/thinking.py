"""The thinking-mode contract: a drafter learns the token stream of one thinking mode, and that
mode is three facts a row records (output/rows.py):

- `enable_thinking`: the job's, sent with each request (chat_template_kwargs);
- `chat_template`: the fingerprint of the server's template (sglang.ServerContract), which put
  the prompt, and the empty think block of a non-thinking prompt, around the answer;
- `reasoning_parser`: the server's, which took the reasoning out of `content` (none: it stays in).

Rows that differ in any of them teach the drafter two different streams, so a run takes one
mode: the gate refuses to mix (`ModeCensus.conflicts`, naming the values, their rows, batches
and ids), and whatever else uses a drafter under a mode (an evaluation) asks
`thinking_mode_mismatch(run, settings)` first.

Rows written before these fields existed have them unrecorded: an unrecorded value is compared
with nothing (it neither conflicts nor agrees), and the gate reports how many rows lack them.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

FIELDS = ("enable_thinking", "chat_template", "reasoning_parser")
NOT_RECORDED = "not recorded"  # a field older rows do not have (None is a value: no parser)
EXAMPLES = 3  # batches and ids named per value in a refusal


@dataclass(frozen=True)
class ThinkingMode:
    enable_thinking: bool | str = NOT_RECORDED
    chat_template: str | None = NOT_RECORDED
    reasoning_parser: str | None = NOT_RECORDED

    @classmethod
    def of_row(cls, row: dict) -> ThinkingMode:
        meta = row.get("metadata") or {}
        return cls(**{f: meta.get(f, NOT_RECORDED) for f in FIELDS})

    @classmethod
    def from_settings(cls, settings: dict) -> ThinkingMode:
        """From a dict with any of the three fields (an evaluation's settings, a gate verdict's
        `thinking_mode`); a missing one is not recorded. ValueError names an unknown field."""
        unknown = sorted(set(settings) - set(FIELDS))
        if unknown:
            raise ValueError(f"thinking mode: unknown field {unknown[0]!r} (fields: "
                             f"{', '.join(FIELDS)})")
        return cls(**{f: settings.get(f, NOT_RECORDED) for f in FIELDS})

    def describe(self) -> str:
        return ", ".join(f"{f}={_show(getattr(self, f))}" for f in FIELDS)


def _show(value) -> str:
    return "none" if value is None else str(value)


def differences(run: ThinkingMode, other: ThinkingMode) -> list[str]:
    """'field: the run's X, the other's Y' for each field recorded on both sides that differs."""
    out = []
    for f in FIELDS:
        mine, theirs = getattr(run, f), getattr(other, f)
        if NOT_RECORDED not in (mine, theirs) and mine != theirs:
            out.append(f"{f}: the run's rows have {_show(mine)}, this has {_show(theirs)}")
    return out


@dataclass
class _Seen:
    rows: int = 0
    batches: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)

    def add(self, rid: str, batch: str | None) -> None:
        self.rows += 1
        if batch and batch not in self.batches and len(self.batches) < EXAMPLES:
            self.batches.append(batch)
        if len(self.ids) < EXAMPLES:
            self.ids.append(rid)


@dataclass
class ModeCensus:
    """Rows per value of each thinking-mode field, with where each value was seen."""
    values: dict[str, dict] = field(default_factory=lambda: {f: {} for f in FIELDS})
    unrecorded: Counter = field(default_factory=Counter)  # field -> rows without it

    def add(self, row: dict, batch: str | None = None) -> None:
        mode, rid = ThinkingMode.of_row(row), str(row.get("id"))
        for f in FIELDS:
            value = getattr(mode, f)
            if value == NOT_RECORDED:
                self.unrecorded[f] += 1
            else:
                self.values[f].setdefault(value, _Seen()).add(rid, batch)

    def mode(self) -> ThinkingMode:
        """The rows' one mode; a field with several values (a conflict) or none reads as not
        recorded."""
        return ThinkingMode(**{f: next(iter(v)) if len(v) == 1 else NOT_RECORDED
                               for f, v in self.values.items()})

    def conflicts(self) -> list[str]:
        """One line per field whose rows disagree: each value, its rows, batches and ids."""
        out = []
        for f, seen in self.values.items():
            if len(seen) > 1:
                parts = [f"{_show(v)} in {s.rows:,} rows (batches {', '.join(s.batches) or '?'}; "
                         f"ids {', '.join(s.ids)})"
                         for v, s in sorted(seen.items(), key=lambda kv: -kv[1].rows)]
                out.append(f"thinking mode mixed: {f} differs across the rows: "
                           + "; ".join(parts) + ". A drafter learns one mode's token stream: "
                           "train on one job per mode, or regenerate the odd rows")
        return out

    def figures(self) -> dict:
        mode = self.mode()
        return {**{f: getattr(mode, f) for f in FIELDS},
                "values": {f: {_show(v): s.rows for v, s in seen.items()}
                           for f, seen in self.values.items()},
                "unrecorded_rows": dict(self.unrecorded)}


def run_thinking_mode(run) -> ThinkingMode:
    """A run's thinking mode from what there is of it: a ThinkingMode; the gate's figures or
    verdict (a dict holding `thinking_mode`), or a mode's settings dict; or its rows (an
    iterable of row dicts). ValueError when the rows mix modes."""
    if isinstance(run, ThinkingMode):
        return run
    if isinstance(run, dict):
        settings = run.get("thinking_mode", run)
        return ThinkingMode.from_settings({f: settings[f] for f in FIELDS if f in settings})
    census = ModeCensus()
    for row in run:
        census.add(row)
    if conflicts := census.conflicts():
        raise ValueError("; ".join(conflicts))
    return census.mode()


def thinking_mode_mismatch(run, settings: dict | ThinkingMode) -> list[str]:
    """Why a use of the run's drafter under `settings` (an evaluation's enable_thinking, and its
    server's chat_template and reasoning_parser, as far as known) is not the mode the run
    trained on; empty when they agree. `run` is anything run_thinking_mode() reads."""
    other = settings if isinstance(settings, ThinkingMode) else ThinkingMode.from_settings(settings)
    return differences(run_thinking_mode(run), other)
