"""Datasets by name: a Hugging Face hub dataset (`hf:ORG/NAME`), or a local copy of one, read
through the `datasets` library as a stream of rows for prompts.py's normalisation.

Three sources, one reading:
- `hf:ORG/NAME`: streamed from the hub (`load_dataset(..., streaming=True)`: nothing is
  downloaded whole, and a million-row split starts at once). HF_TOKEN, HF_ENDPOINT and
  HF_HUB_OFFLINE work as they do for `datasets` itself.
- a directory written by `save_to_disk` (its `state.json` or `dataset_dict.json`): read with
  `load_from_disk`, memory-mapped;
- any other directory: a dataset in the hub's own layout (a clone of the hub repository, or
  files under `data/` with a README's `configs`), read as the hub would serve it.

`subset` is the dataset's configuration (the hub's "subset"), `split` its split (train by
default). Only the columns prompts.py reads are decoded (a dataset's images and long metadata
are never touched). A row's number is its position in the split, 1-based, as a Parquet file's.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

HUB_PREFIX = "hf:"
DEFAULT_SPLIT = "train"


class HubError(ValueError):
    """The named dataset, its subset or its split cannot be read (prompts.py: DatasetError)."""


def is_named(source: str | Path) -> bool:
    """A dataset read through `datasets`: a hub name, or a directory (a local copy of one)."""
    return str(source).startswith(HUB_PREFIX) or Path(source).is_dir()


def describe(source: str | Path, subset: str | None, split: str | None) -> str:
    """The source as a job records it and messages name it: `hf:org/name` with its subset and
    split when they are not the defaults."""
    extra = [f"subset {subset}"] if subset else []
    if is_named(source) and (split or DEFAULT_SPLIT) != DEFAULT_SPLIT:
        extra.append(f"split {split}")
    return f"{source} ({', '.join(extra)})" if extra else str(source)


def records(source: str | Path, subset: str | None, split: str | None, *,
            columns: Sequence[str], required: Sequence[str]) -> Iterator[tuple[int, dict]]:
    """(row number, row) of the split, lazily, with only those of `columns` it has (at least
    one of `required`). Raises HubError now for a source that cannot be opened (not found, no
    such subset or split, none of `required`), and during iteration for one that fails later."""
    rows = _open(str(source), subset, split or DEFAULT_SPLIT, columns, required)
    return _numbered(rows, str(source))


def _open(source: str, subset: str | None, split: str, columns: Sequence[str],
          required: Sequence[str]):
    import datasets

    name = source.removeprefix(HUB_PREFIX)
    try:
        if not source.startswith(HUB_PREFIX) and _saved_to_disk(Path(source)):
            if subset:
                raise HubError(f"{source}: a dataset saved with save_to_disk has no subsets "
                               f"(--subset {subset})")
            saved = datasets.load_from_disk(source)
            if isinstance(saved, datasets.DatasetDict):
                if split not in saved:
                    raise HubError(f"{source}: no split {split!r} (splits: "
                                   f"{', '.join(saved)})")
                saved = saved[split]
            elif split != DEFAULT_SPLIT:
                raise HubError(f"{source}: a single saved split, not {split!r}: leave --split out")
            return _columns(saved, columns, required)
        if not name.strip("/"):
            raise HubError(f"{source}: expected hf:ORG/NAME")
        return _columns(datasets.load_dataset(name, subset, split=split, streaming=True),
                        columns, required)
    except HubError:
        raise
    except datasets.exceptions.DatasetNotFoundError as exc:
        raise HubError(f"{source}: no such dataset ({_first_line(exc)})") from None
    except (ValueError, FileNotFoundError, ConnectionError, OSError) as exc:
        # datasets' own words name the subset or split it lacks and the ones it has
        raise HubError(f"{source}: {_first_line(exc)}") from None


def _saved_to_disk(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _columns(dataset, columns: Sequence[str], required: Sequence[str]) -> Any:
    """Only the `columns` prompts.py reads, when the dataset says which it has."""
    names = getattr(dataset, "column_names", None)
    if names:
        keep = [c for c in columns if c in names]
        if not set(keep) & set(required):
            *others, last = (repr(c) for c in required)
            raise HubError(f"no {', '.join(others)} or {last} column (columns: "
                           f"{', '.join(names)})")
        return dataset.select_columns(keep)
    return dataset


def _numbered(rows, source: str) -> Iterator[tuple[int, dict]]:
    number = 0
    try:
        for number, row in enumerate(rows, 1):
            yield number, row
    except Exception as exc:  # a shard unreadable halfway, a connection lost while streaming
        raise HubError(f"{source}: cannot read past row {number}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]
