"""A manifest is data (a bucket or a Redis others write to): a batch name or key in it that
sealing could not have written is refused, with the entry named, and nothing is written, by
`manage.py export` in every format and by the readers of the shipped rows."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_training_data import good_row, manage, write_batches

from dflash_tasks.output.export import ExportError, export
from dflash_tasks.output.storage import LocalStorage, StorageError
from dflash_tasks.training.data.exports import export_training
from dflash_tasks.training.data.gate import Rules
from dflash_tasks.training.data.reader import InvalidManifest
from dflash_tasks.training.torch_dataset import JobDataset

BAD_NAMES = ["../x", "/abs/x", "a/../../x", ""]


def tamper(root: Path, job: str, **fields) -> dict:
    """The job's manifest with its last batch entry changed (fields), as someone else wrote it."""
    path = root / job / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["batches"][-1].update(fields)
    path.write_text(json.dumps(manifest))
    return manifest["batches"][-1]


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")} if root.exists() else set()


@pytest.mark.parametrize("name", BAD_NAMES)
def test_export_refuses_a_batch_name_sealing_never_writes(tmp_path, name):
    source = tmp_path / "deep" / "source"
    write_batches(source, "j", [good_row(i) for i in range(6)], per_batch=2)
    tamper(source, "j", name=name, key=f"j/batches/{name}.jsonl.zst")
    before = files_under(tmp_path)
    dest = tmp_path / "deep" / "source" / "to"

    result = manage("export", "--job", "j", "--from", str(source), "--to", str(dest))
    assert result.returncode == 1, result.stdout + result.stderr
    err = " ".join(result.stderr.split())
    assert f"batch entry 2 has the name {name!r}" in err and "refused" in err
    assert files_under(tmp_path) == before  # not under --to, not above it: nothing at all
    assert not Path("/abs/x.jsonl.zst").exists()

    for fmt in ("specforge-tokenized", "specforge-conversations"):
        with pytest.raises(InvalidManifest, match="batch entry 2"):
            export_training(LocalStorage(source), "j", fmt, dest, Rules(min_loss_tokens=0))
    with pytest.raises(InvalidManifest):
        list(JobDataset("j", source))
    assert files_under(tmp_path) == before


def test_export_refuses_a_key_that_is_not_the_batch_names(tmp_path):
    source = tmp_path / "source"
    write_batches(source, "j", [good_row(i) for i in range(4)], per_batch=2)
    outside = tmp_path / "elsewhere.jsonl.zst"
    outside.write_bytes((source / tamper(source, "j")["key"]).read_bytes())
    tamper(source, "j", key="../elsewhere.jsonl.zst")  # a real batch, read from outside --from
    with pytest.raises(ExportError, match=r"batch entry 1 \(batch-\d+-0000\) has the key"):
        export(LocalStorage(source), "j", tmp_path / "to")
    assert not (tmp_path / "to").exists()


def test_local_storage_keeps_keys_under_its_root(tmp_path):
    storage = LocalStorage(tmp_path / "root")
    for key in ("../x", "/abs/x", "a/../../x"):
        with pytest.raises(StorageError, match="leads outside"):
            storage.put(key, b"data")
        with pytest.raises(StorageError, match="leads outside"):
            storage.get(key)
    storage.put("a/../b", b"ok")  # stays under the root
    assert (tmp_path / "root" / "b").read_bytes() == b"ok"
    assert all(p.is_relative_to(tmp_path / "root") for p in tmp_path.rglob("*") if p.name != "root")


def test_a_good_manifest_still_exports(tmp_path):
    write_batches(tmp_path / "s", "j", [good_row(i) for i in range(4)], per_batch=2)
    report = export(LocalStorage(tmp_path / "s"), "j", tmp_path / "to")
    assert report.batches == 2 and report.rows == 4


@pytest.mark.parametrize("name", BAD_NAMES + ["..", "a/b"])
@pytest.mark.parametrize("field", ["run", "job"])
def test_a_training_run_named_outside_the_training_dir_is_refused(tmp_path, field, name):
    """A run comes from Redis, which others write to: a run or job name that is not one
    `manage.py train` could have made is refused before its data/ and checkpoints/ (and
    SpecForge's cache under them) exist anywhere."""
    from dflash_tasks.core.settings import Settings
    from dflash_tasks.training.queue.execute import RunSession, TrainingError
    from dflash_tasks.training.queue.runs import Run

    names = {"run": "j-train-1", "job": "j", field: name}
    run = Run(name=names["run"], job=names["job"], trainer="command", status="queued")
    root = tmp_path / "deep" / "training"
    with pytest.raises(TrainingError, match=f"training run refused: its {field} name: invalid "
                                            f"job name {name!r}"):
        RunSession(None, run, Settings(train_dir=root), publish_state=print, hostname="h")
    assert files_under(tmp_path) == set()


def test_a_good_training_run_stays_under_the_training_dir(tmp_path):
    from dflash_tasks.core.settings import Settings
    from dflash_tasks.training.queue.execute import RunSession
    from dflash_tasks.training.queue.runs import Run

    run = Run(name="j.v2-train-1", job="j.v2", trainer="command", status="queued")
    session = RunSession(None, run, Settings(train_dir=tmp_path / "training"),
                         publish_state=print, hostname="h")
    assert session.run_dir == tmp_path / "training" / "j.v2-train-1"
    assert session.ckpt_dir == session.run_dir / "checkpoints"
