"""Datasets by name (issue 39): `enqueue --dataset hf:ORG/NAME --subset S --split T` reads through
the `datasets` library, as does a local copy of a hub dataset (a `save_to_disk` directory, or a
directory in the hub's own layout: Parquet shards under data/, a README whose `configs` name the
subsets). Nothing here reaches the hub: the datasets are made by the test and saved in those
formats, and `hf:` runs offline (HF_HUB_OFFLINE, tests/conftest.py), where it must fail cleanly.
Every source gives the same prompts, ids and normalisation as the same rows in a JSONL file."""
from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from conftest import write_jsonl

from dflash_tasks.ingest.prompts import DatasetError, read_prompts

# A messages-style post-training set (with an answer to drop, one row without an id, one bad row)
# and a ShareGPT one, as their hub cards lay them out.
CHAT = [{"id": f"c{i:03d}", "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": f"What is {i} + {i}?"},
                                         {"role": "assistant", "content": f"{2 * i}"}],
         "source": "synthetic", "score": i / 10} for i in range(40)]
CHAT.append({"id": None, "messages": [{"role": "user", "content": "No id: hashed."}],
             "source": "synthetic", "score": 0.0})
CHAT.append({"id": "bad", "messages": [{"role": "narrator", "content": "x"}],
             "source": "synthetic", "score": 0.0})
SHAREGPT = [{"id": f"s{i:03d}", "conversations": [{"from": "human", "value": f"Tell me about {i}."},
                                                  {"from": "gpt", "value": "Sure."}]}
            for i in range(25)]
README = """---
configs:
- config_name: chat
  default: true
  data_files:
  - split: train
    path: chat/train-*.parquet
  - split: test
    path: chat/test-*.parquet
- config_name: sharegpt
  data_files:
  - split: train
    path: sharegpt/train-*.parquet
---
# A test dataset in the hub's layout
"""


def hub_layout(root: Path) -> Path:
    """A dataset repository as the hub stores it: Parquet shards per subset and split."""
    for folder, split, rows in (("chat", "train", CHAT[:30] + CHAT[40:]), ("chat", "test", CHAT[30:40]),
                                ("sharegpt", "train", SHAREGPT)):
        (root / folder).mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list(rows).to_parquet(str(root / folder / f"{split}-00000-of-00001.parquet"))
    (root / "README.md").write_text(README)
    return root


def as_jsonl(tmp_path: Path, rows: list[dict], name: str) -> list:
    return list(read_prompts(write_jsonl(tmp_path / name, rows)))


def test_a_hub_layout_reads_as_its_rows_in_a_file_do(tmp_path):
    root = hub_layout(tmp_path / "repo")
    chat = list(read_prompts(root))  # the default subset, split train
    assert chat == as_jsonl(tmp_path, CHAT[:30] + CHAT[40:41], "chat.jsonl") and len(chat) == 31
    assert chat[0].messages == ({"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "What is 0 + 0?"})  # the answer dropped
    assert chat[-1].id.startswith("h")  # no id: the content's hash, as a file's
    assert list(read_prompts(root, split="test")) == as_jsonl(tmp_path, CHAT[30:40], "test.jsonl")
    sharegpt = list(read_prompts(root, subset="sharegpt"))
    assert [p.id for p in sharegpt] == [f"s{i:03d}" for i in range(25)]
    assert sharegpt[3].messages == ({"role": "user", "content": "Tell me about 3."},)


def test_a_save_to_disk_copy_reads_by_split(tmp_path):
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(CHAT[:20]),
                          "validation": datasets.Dataset.from_list(CHAT[20:30])}).save_to_disk(str(saved))
    assert list(read_prompts(saved)) == as_jsonl(tmp_path, CHAT[:20], "a.jsonl")
    assert [p.id for p in read_prompts(saved, split="validation")] == [f"c{i:03d}" for i in range(20, 30)]
    with pytest.raises(DatasetError, match=r"no split 'test' \(splits: train, validation\)"):
        read_prompts(saved, split="test")


@pytest.mark.parametrize("args, says", [
    (("--split", "nope"), "nope"),
    (("--subset", "nope"), "nope"),
])
def test_a_missing_split_or_subset_is_named_and_leaves_nothing(cluster, tmp_path, args, says):
    c = cluster()  # stopped after the test: no worker outlives it
    root = hub_layout(tmp_path / "repo")
    result = c.manage("enqueue", "--dataset", str(root), *args, "--job", "named", check=False)
    assert result.returncode != 0 and says in result.stderr and str(root) in result.stderr
    assert "Traceback" not in result.stderr and "not created" in result.stderr
    assert not c.r.keys("dflash:{named}*")


def test_enqueue_by_name_records_the_source_and_resumes(cluster, tmp_path):
    c = cluster()  # stopped after the test: no worker outlives it
    root = hub_layout(tmp_path / "repo")
    c.manage("enqueue", "--dataset", str(root), "--subset", "sharegpt", "--job", "named")
    assert c.status("named")["total"] == 25
    assert c.r.hget("dflash:{named}:config", "dataset").decode() == f"{root} (subset sharegpt)"
    again = c.manage("enqueue", "--dataset", str(root), "--subset", "sharegpt", "--job", "named")
    assert c.status("named")["total"] == 25, again.stdout
    # A file takes no --subset or --split: said, and nothing changes.
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "x", "prompt": "hi"}])
    wrong = c.manage("enqueue", "--dataset", str(data), "--split", "test", "--job", "other", check=False)
    assert wrong.returncode != 0 and "--split are for a dataset by name" in wrong.stderr
    assert not c.r.keys("dflash:{other}*")


def test_a_hub_name_offline_fails_with_its_name(cluster, tmp_path):
    """hf:ORG/NAME goes to the hub; offline, the command says it could not reach it."""
    c = cluster()  # stopped after the test: no worker outlives it
    result = c.manage("enqueue", "--dataset", "hf:example-org/no-such-set", "--split", "train",
                      "--job", "hub", check=False)
    assert result.returncode != 0 and "hf:example-org/no-such-set" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not c.r.keys("dflash:{hub}*")
    assert json.loads(json.dumps(result.stderr))  # printable as it is
