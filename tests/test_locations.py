"""A storage location that looks like a mistyped S3 URI is refused before anything is stored
(issue 42, item 1): `s3:/b/p`, `s3//b/p`, `S3://b/p`, `s3a://b/p` would otherwise name a local
directory, and a job keeps its output location for good. Another scheme is refused too; a local
path, relative or absolute, is taken as it is."""
from __future__ import annotations

import pytest
from conftest import write_jsonl
from pydantic import ValidationError
from support import ROOT

from dflash_tasks.core.settings import Settings, check_location

TYPOS = ["s3:/bucket/p", "s3//bucket/p", "S3://bucket/p", "s3a://bucket/p", "s3:bucket/p"]


@pytest.mark.parametrize("where", TYPOS)
def test_a_mistyped_s3_uri_says_the_uri_meant(where):
    with pytest.raises(ValueError, match="write s3://bucket/p"):
        check_location(where)


@pytest.mark.parametrize("where", ["gs://bucket/p", "file:///data/out", "https://example.com/x"])
def test_another_scheme_is_refused(where):
    with pytest.raises(ValueError, match="is not a storage this project writes"):
        check_location(where)


@pytest.mark.parametrize("where", ["s3://bucket/p", "s3/run1", "./s3:x", "/data/out", "out"])
def test_uris_and_paths_that_cannot_be_mistaken_pass(where):
    assert check_location(where) == where


def test_output_dir_must_be_a_directory(monkeypatch):
    for value, says in (("s3:/bucket/p", "mistyped S3 URI"), ("s3://bucket/p", "DFLASH_S3_URI")):
        monkeypatch.setenv("DFLASH_OUTPUT_DIR", value)
        with pytest.raises(ValidationError, match=says):
            Settings()


def test_commands_refuse_a_mistyped_location_and_change_nothing(cluster, tmp_path):
    c = cluster()  # stopped after the test: no worker outlives it
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "hi"}])
    c.manage("enqueue", "--dataset", str(data), "--job", "kept")
    before = {k: c.r.type(k) for k in c.r.keys("*")}
    for args in (("enqueue", "--dataset", str(data), "--job", "typo", "--output", "s3:/bucket/p"),
                 ("enqueue", "--dataset", str(data), "--job", "typo", "--output", "s3//bucket/p"),
                 ("stats", "--job", "kept", "--from", "S3://bucket/p"),
                 ("validate", "--job", "kept", "--from", "s3a://bucket/p"),
                 ("export", "--job", "kept", "--to", str(tmp_path / "x"), "--from", "s3:bucket/p")):
        result = c.manage(*args, check=False)
        assert result.returncode != 0 and "write s3://bucket/p" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert {k: c.r.type(k) for k in c.r.keys("*")} == before
    assert not (tmp_path / "x").exists() and not any(tmp_path.glob("s3*"))
    assert not any(ROOT.glob("s3*"))
