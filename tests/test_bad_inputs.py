"""Bad input to any command (issue 42, item 4): each exits non-zero with a message that names
the problem, prints no traceback, and changes nothing, in Redis or in the output directory.
The commands run as an operator types them (manage.py, a subprocess) against a deployment that
holds one job; nothing else runs, so any change is the command's."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from conftest import write_jsonl

JOB = "kept"


def redis_state(c) -> dict[bytes, str]:
    return {key: hashlib.sha1(c.r.dump(key) or b"").hexdigest() for key in c.r.keys("*")}


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


@pytest.fixture
def deployment(cluster, tmp_path):
    tmp = tmp_path
    c = cluster()  # stopped after the test: no worker outlives it
    data = write_jsonl(tmp / "d.jsonl", [{"id": f"p{i}", "prompt": f"q {i}"} for i in range(5)])
    c.manage("enqueue", "--dataset", str(data), "--job", JOB)
    (tmp / "a-file").write_text("not a directory")
    (tmp / "train.toml").write_text('[reference]\ntarget_model = "/no/such/model"\n')
    return c, tmp, data


def cases(tmp: Path, data: Path) -> list[tuple[tuple[str, ...], str]]:
    """(arguments, a word the message must say)."""
    under_file = str(tmp / "a-file" / "sub")
    return [
        (("status", "--job", "nope"), "nope"),
        (("stats", "--job", "nope"), "nope"),
        (("stats", "--job", JOB, "--plot", under_file + ".png"), "a-file"),
        (("stats", "--job", JOB, "--from", "s3:/bucket/p"), "s3://bucket/p"),
        (("failed", "--job", "nope"), "nope"),
        (("validate", "--job", "nope"), "nope"),
        (("export", "--job", JOB, "--to", under_file), "is a file"),
        (("export", "--job", JOB, "--to", str(tmp / "x"), "--from", "gs://b/p"), "gs:"),
        (("enqueue", "--dataset", str(tmp / "missing.jsonl"), "--job", "new"), "missing.jsonl"),
        (("enqueue", "--dataset", under_file + ".jsonl", "--job", "new"), "a-file"),
        (("enqueue", "--dataset", str(data), "--job", "new", "--max-output-tokens", "-5"), "-5"),
        (("enqueue", "--dataset", str(data), "--job", "new", "--temperature", "hot"), "hot"),
        (("enqueue", "--dataset", str(data), "--job", "new", "--output", "s3//b/p"), "s3://b/p"),
        (("enqueue", "--dataset", str(data), "--job", "bad name!"), "bad name!"),
        (("enqueue", "--dataset", str(data), "--job", "new", "--samples", "0"), "--samples"),
        (("enqueue", "--dataset", str(data), "--job", "new", "--split", "test"), "--split"),
        (("set", "--job", "nope", "--temperature", "0.5"), "nope"),
        (("pause", "--job", "nope"), "nope"),
        (("resume", "--job", "nope"), "nope"),
        (("cancel", "--job", "nope", "--yes"), "nope"),
        (("delete", "--job", "nope", "--yes"), "nope"),
        (("retry-failed", "--job", "nope"), "nope"),
        (("regenerate", "--job", "nope", "--finish-reason", "length"), "nope"),
        (("train", "--job", JOB, "--smoke", "--config", str(tmp / "train.toml")), "/no/such/model"),
        (("train-status", "--run", "nope"), "nope"),
        (("train-cancel", "--run", "nope"), "nope"),
        (("nosuchcommand",), "nosuchcommand"),
        # Every other subcommand, and bad numbers to those above.
        (("jobs", "--bogus"), "--bogus"),
        (("stats", "--job", JOB, "--sample", "-1"), "-1"),
        (("validate", "--job", JOB, "--max-spike-share", "1.5"), "1.5"),
        (("validate", "--job", JOB, "--config", str(tmp / "no.toml")), "no.toml"),
        (("set", "--job", JOB, "--max-output-tokens", "0"), "0"),
        (("set", "--job", JOB, "--temperature", "warm"), "warm"),
        (("regenerate", "--job", JOB, "--finish-reason", "length", "--limit", "0"), "0"),
        (("regenerate", "--job", JOB, "--finish-reason", "bored"), "bored"),
        (("remove-chunks", "--job", "nope", "--location", str(tmp), "--through", "1"), "nope"),
        (("remove-chunks", "--job", JOB, "--location", "s3:/b/p", "--through", "1"), "s3://b/p"),
        (("remove-chunks", "--job", JOB, "--location", str(tmp), "--through", "-1"), "-1"),
        (("remove-chunks", "--job", JOB, "--location", str(tmp), "--through", "1"), "no chunk"),
        (("train", "--job", "nope"), "nope"),
        (("train", "--job", JOB, "--config", under_file + ".toml"), "a-file"),
        (("train-eval", "--run", "nope"), "nope"),
        (("train-eval", "--checkpoint", str(tmp / "no-ckpt"), "--prompts", str(data)), "no-ckpt"),
        (("train-eval", "--checkpoint", str(tmp), "--max-new-tokens", "1"), "1"),
        (("worker", "--gpu", "-1"), "-1"),
        (("worker", "--queue", "gpu0"), "gpu0"),
        (("worker", "--gpu", "0", "--node", "bad node"), "bad node"),
        (("worker", "--gpu", "0", "--sglang-url", "localhost:30000"), "localhost:30000"),
        (("worker", "--gpu", "0", "--loglevel", "LOUD"), "LOUD"),
        (("beat", "--loglevel", "LOUD"), "LOUD"),
        (("flower", "--port", "70000", "--no-auth"), "70000"),
        (("sim-server", "--port", "x"), "'x'"),
        (("sim-server", "--port", "1", "--p-over-4096", "2"), "2"),
    ]


def test_bad_input_is_named_and_changes_nothing(deployment):
    c, tmp, data = deployment
    redis_before, files_before = redis_state(c), files_under(c.output_dir)
    failures = []
    for args, says in cases(tmp, data):
        result = c.manage(*args, check=False)
        said = result.stdout + result.stderr
        if result.returncode == 0 or "Traceback" in said or says not in said:
            failures.append(f"manage.py {' '.join(args)} -> {result.returncode}:\n{said[-1500:]}")
        if redis_state(c) != redis_before or files_under(c.output_dir) != files_before:
            failures.append(f"manage.py {' '.join(args)} changed the deployment")
            redis_before, files_before = redis_state(c), files_under(c.output_dir)
    assert not failures, "\n\n".join(failures)
    assert not (tmp / "x").exists()


def test_enqueue_names_every_duplicate_id_it_skips(cluster, tmp_path):
    c = cluster()  # stopped after the test: no worker outlives it
    data = write_jsonl(tmp_path / "d.jsonl", [
        {"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"},
        {"id": "[bold]c", "prompt": "z"}, {"id": "[bold]c", "prompt": "w"}])
    out = c.manage("enqueue", "--dataset", str(data), "--job", "dups")
    assert "line 3: duplicate id 'a' (the prompt of line 1 is kept)" in out.stderr, out.stderr
    assert "line 5: duplicate id '[bold]c' (the prompt of line 4 is kept)" in out.stderr
    assert c.status("dups")["total"] == 3


def test_a_node_or_gpu_no_worker_registered_is_named_with_those_that_are(cluster, tmp_path):
    """Accepted (a node that joins later takes the work at once), with a warning that names the
    registered ones: a typo is seen before the job waits for a node that will never come."""
    c = cluster()  # stopped after the test: no worker outlives it
    c.start_server(0)
    c.start_worker(0)
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "x"}])
    gpu = c.gpu(0)
    typo = gpu.replace("@", "@x")
    out = c.manage("enqueue", "--dataset", str(data), "--job", "typo", "--gpus", typo)
    assert f"no worker has registered {typo}" in out.stderr and gpu in out.stderr, out.stderr
    out = c.manage("enqueue", "--dataset", str(data), "--job", "typo2", "--nodes", "lcoal")
    assert "no worker has registered lcoal" in out.stderr and f"nodes {gpu.node}" in out.stderr
    out = c.manage("enqueue", "--dataset", str(data), "--job", "fine", "--gpus", gpu)
    assert "no worker has registered" not in out.stderr
