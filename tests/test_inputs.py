"""Inputs checked before they cost anything, and one output location per job.

Each bad input gets a message that names the value and the choices, exits 2 (a usage error) or
1, prints no traceback, and changes nothing. A job keeps where its batches go, resolved when it
is made, so every command that reads them finds them from any directory; --from overrides."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import click
import pytest
from conftest import Cluster, write_jsonl
from support import ROOT
from test_pipeline import start

from dflash_tasks.cli import COMMANDS, cli


def rows(n: int) -> list[dict]:
    return [{"id": f"q{i}", "prompt": f"Question {i}: why is the sky blue at hour {i}?"}
            for i in range(n)]


def refused(c: Cluster, *args: str, cwd=ROOT, code: int = 2) -> str:
    result = subprocess.run([sys.executable, str(ROOT / "manage.py"), *args], env=c.env, cwd=cwd,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    return " ".join(result.stderr.split())


# -- help: one convention, a line for every option ------------------------------------------------

def test_every_option_has_a_line_and_defaults_are_written_one_way():
    ctx = click.Context(cli)
    for name in COMMANDS:
        command = cli.get_command(ctx, name)
        for param in command.params:
            if not isinstance(param, click.Option) or param.hidden:
                continue
            assert param.help, f"manage.py {name} {param.opts[0]} has no help line"
            # A default goes in click's own [default: ...], never hand-written as "[X]"
            assert not re.search(r"\[[^]]*\]\.?\s*$", param.help), \
                f"manage.py {name} {param.opts[0]}: write the default with show_default"


def test_set_shows_no_defaults_and_enqueue_shows_a_new_jobs():
    ctx = click.Context(cli)
    set_help = cli.get_command(ctx, "set").get_help(ctx)
    enqueue_help = cli.get_command(ctx, "enqueue").get_help(ctx)
    assert "default" not in set_help and "keeps the job's current value" in " ".join(set_help.split())
    assert "[default: 8192; 1<=x<=131072]" in " ".join(enqueue_help.split())


# -- bad inputs -----------------------------------------------------------------------------------

def test_each_bad_input_is_named_with_its_choices_and_changes_nothing(redis_url, tmp_path):
    c = Cluster(tmp_path, redis_url)
    data = write_jsonl(tmp_path / "d.jsonl", rows(5))
    c.manage("enqueue", "--dataset", str(data), "--job", "typo")
    before = {k: c.r.dump(k) for k in c.r.keys("*")}

    said = refused(c, "regenerate", "--job", "typo", "--finish-reason", "lenght")
    assert "'lenght' is not a finish reason (did you mean 'length'?)" in said
    assert "this job's rows ended: length 0, stop 0" in said
    said = refused(c, "stats", "--job", "typo", "--plot", str(tmp_path / "missing" / "x.png"))
    assert f"the directory {tmp_path / 'missing'} does not exist" in said
    assert "name it *.png" in refused(c, "stats", "--job", "typo", "--plot", str(tmp_path / "x.txt"))
    assert "Did you mean stats or status?" in refused(c, "stauts", "--job", "typo")
    assert "is not a failure reason" in refused(c, "retry-failed", "--job", "typo", "--reason", "timout")
    assert "is not a GPU name" in refused(c, "retry-failed", "--job", "typo", "--gpu", "3")
    # The output location: a file where a directory goes, another place for a job that has one.
    (tmp_path / "a-file").write_text("x")
    said = refused(c, "enqueue", "--dataset", str(data), "--job", "fresh", "--output",
                   str(tmp_path / "a-file" / "out"), code=1)
    assert f"--output={tmp_path / 'a-file' / 'out'}: {tmp_path / 'a-file'} is a file" in said
    said = refused(c, "enqueue", "--dataset", str(data), "--job", "typo", "--output",
                   str(tmp_path / "elsewhere"))
    assert f"job typo keeps its batches in {c.output_dir}" in said
    # a scheme is refused as the option's bad value, before the job is read (settings.py's
    # check_location)
    assert "ftp: is not a storage this project writes (a directory, or s3://bucket/prefix)" in \
        refused(c, "enqueue", "--dataset", str(data), "--job", "fresh", "--output", "ftp://host/x")
    assert {k: c.r.dump(k) for k in c.r.keys("*")} == before       # nothing changed
    assert not (tmp_path / "elsewhere").exists()


def test_bodies_on_s3_without_credentials_are_refused_before_anything_is_stored(
        redis_url, tmp_path, moto):
    """Before, the prompts were read, nothing could be written, and the message warned that
    chunks "could not be removed, remove them by hand" though none had been written."""
    c = Cluster(tmp_path, redis_url, s3_uri="s3://dflash-test/runs")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        c.env.pop(name, None)
    c.env.update({"AWS_ENDPOINT_URL": moto.url, "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                  "AWS_CONFIG_FILE": "/nonexistent", "AWS_EC2_METADATA_DISABLED": "true"})
    data = write_jsonl(tmp_path / "d.jsonl", rows(5))
    said = refused(c, "enqueue", "--dataset", str(data), "--job", "nocreds", "--bodies", "storage",
                   code=1)
    assert "DFLASH_S3_URI=s3://dflash-test/runs but no AWS credentials on this node" in said
    assert "nothing was stored" in said and "by hand" not in said
    assert c.r.keys("*") == []


# -- one output location per job ------------------------------------------------------------------

def test_a_jobs_batches_are_found_from_any_directory_and_from_overrides(cluster, tmp_path):
    c = cluster()
    start(c, gpus=(0,), sim_args=("--slots", "20", "--decode-tps", "4000"))
    data = write_jsonl(tmp_path / "d.jsonl", rows(30))
    own = tmp_path / "own-output"
    # enqueued from another directory with a relative --output: the job keeps it made absolute
    (tmp_path / "here").mkdir()
    subprocess.run([sys.executable, str(ROOT / "manage.py"), "enqueue", "--dataset", str(data),
                    "--job", "placed", "--output", "../own-output"], cwd=tmp_path / "here",
                   env=c.env, check=True, capture_output=True)
    snap = c.wait_done("placed")
    assert snap["output"] == str(own) and (own / "placed" / "manifest.json").exists()
    assert not (c.output_dir / "placed" / "batches").exists()       # not beat's own directory
    listed = json.loads(c.manage("jobs", "--json").stdout)
    assert [(j["job"], j["output"]) for j in listed] == [("placed", str(own))]

    anywhere = tmp_path / "anywhere"
    anywhere.mkdir()
    env = {**c.env, "DFLASH_OUTPUT_DIR": "output"}  # a relative default that names nothing here
    # validate with a max length above the job's cap: the trainer's default (4096) would drop
    # the rows over it, and the gate say so (issue 43: cut them instead).
    for args in (("validate", "--job", "placed", "--max-length", "16384"),
                 ("stats", "--job", "placed", "--json"),
                 ("export", "--job", "placed", "--to", "copy")):
        result = subprocess.run([sys.executable, str(ROOT / "manage.py"), *args], cwd=anywhere,
                                env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, (args, result.stdout, result.stderr)
    assert json.loads(subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "stats", "--job", "placed", "--json"],
        cwd=anywhere, env=env, capture_output=True, text=True).stdout)["completed"] == 30
    # --from reads another copy: the export just made
    copy = anywhere / "copy"
    assert c.manage("validate", "--job", "placed", "--from", str(copy),
                    "--max-length", "16384").returncode == 0
    assert refused(c, "validate", "--job", "placed", "--from", str(tmp_path / "nothing"),
                   code=1)


@pytest.mark.parametrize("args", [("--help",), ("enqueue", "--help"), ("set", "--help")])
def test_help_says_where_redis_is_and_runs_without_one(args):
    out = subprocess.run([sys.executable, str(ROOT / "manage.py"), *args], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin", "DFLASH_REDIS_URL":
                                         "redis://127.0.0.1:1/0"}, timeout=60)
    assert out.returncode == 0, out.stderr
    if args == ("--help",):
        text = " ".join(out.stdout.split())
        assert "DFLASH_REDIS_URL" in text and "redis://127.0.0.1:6379/0" in text
