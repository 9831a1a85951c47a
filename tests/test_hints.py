"""Every hint the CLI prints that is a command works when pasted (issue 42, item 5): each is
provoked on a real deployment, read from what the command printed (a hint is in backticks), and
run as an operator pastes it, from a directory that is not the repository's. The training
hints are pasted in test_train_queue, remove-chunks' in test_prompt_bodies."""
from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, python, write_jsonl
from support import hints_in, paste, wait_until

PROMPTS = [{"id": f"p{i}", "prompt": f"w{i} w{i + 1} w{i + 2}"} for i in range(4)]


@pytest.fixture
def elsewhere(tmp_path):
    where = tmp_path / "elsewhere"
    where.mkdir()
    return where


def runs(c, hint: str, elsewhere) -> None:
    result = paste(hint, c.env, elsewhere)
    assert result.returncode == 0 and "Traceback" not in result.stderr, \
        (hint, result.stdout, result.stderr)


def pasted(c, printed: str, elsewhere, expected: int) -> list[str]:
    """Paste every hint in `printed` (`expected` of them); returns them."""
    found = hints_in(printed)
    assert len(found) == expected, (found, printed)
    for hint in found:
        runs(c, hint, elsewhere)
    return found


def test_every_hint_of_the_job_commands_runs_when_pasted(cluster, tmp_path, elsewhere):
    c = cluster()
    c.start_server(0, "--context-length", "2048", "--median-tokens", "400")
    c.start_worker(0)
    data = write_jsonl(tmp_path / "d.jsonl", PROMPTS)
    # Every prompt fails at once: the cap exceeds the simulated server's context.
    c.manage("enqueue", "--dataset", str(data), "--job", "h", "--max-output-tokens", "4096")
    wait_until(lambda: c.status("h")["failed"] == 4, timeout=120, what="every prompt failed")
    said = pasted(c, c.manage("failed", "--job", "h").stdout, elsewhere, 1)
    assert said == ["manage.py retry-failed --job h"]
    c.manage("set", "--job", "h", "--max-output-tokens", "64")
    retried = c.manage("retry-failed", "--job", "h", "--include-permanent").stdout
    assert pasted(c, retried, elsewhere, 1) == ["manage.py status --job h"]
    # No beat runs: status says to start one (pasted as far as its --help); its rows cut at
    # the cap of 64 are split, looping or not, with the stats that say more.
    assert pasted(c, c.manage("status", "--job", "h").stdout, elsewhere, 2) == \
        ["manage.py stats --job h", "manage.py beat"]

    # A running job refuses a delete: pause it (or cancel it) first; the pause is pasted.
    refused = c.manage("delete", "--job", "h", "--yes", check=False)
    assert refused.returncode != 0
    assert hints_in(refused.stderr) == ["manage.py pause --job h", "manage.py cancel --job h"]
    runs(c, "manage.py pause --job h", elsewhere)
    assert c.status("h")["status"] == "paused"
    # Enqueued again while paused: it stays paused, and says how to resume.
    again = c.manage("enqueue", "--dataset", str(data), "--job", "h")
    pasted(c, again.stderr, elsewhere, 1)
    assert c.status("h")["status"] == "running"
    # Cancelled: resume generates the rest, or delete removes it (each pasted in its turn).
    cancelled = c.manage("cancel", "--job", "h", "--yes").stdout
    assert hints_in(cancelled) == ["manage.py resume --job h", "manage.py delete --job h"]
    runs(c, "manage.py resume --job h", elsewhere)
    assert c.status("h")["status"] == "running"
    c.manage("cancel", "--job", "h", "--yes")
    refused = c.manage("pause", "--job", "h", check=False)  # cancelled: not pausable
    assert hints_in(refused.stderr) == hints_in(cancelled), refused.stderr
    runs(c, "manage.py delete --job h", elsewhere)  # its confirmation answered
    assert c.manage("status", "--job", "h", check=False).returncode != 0  # gone

    # A done job with rows cut by its cap: continuing them needs a higher cap first.
    c.start_beat()
    c.manage("enqueue", "--dataset", str(data), "--job", "cap", "--max-output-tokens", "64")
    c.wait_done("cap")
    capped = c.manage("regenerate", "--job", "cap", "--finish-reason", "length", "--continue",
                      check=False)
    assert pasted(c, capped.stderr, elsewhere, 1) == \
        ["manage.py set --job cap --max-output-tokens 128"]
    refused = c.manage("pause", "--job", "cap", check=False)  # done: not pausable
    assert hints_in(refused.stderr) == [
        "manage.py retry-failed --job cap",
        "manage.py regenerate --job cap --finish-reason length", "manage.py delete --job cap"]
    for hint in hints_in(refused.stderr)[:2]:  # alternatives, each fine here; delete: above
        runs(c, hint, elsewhere)
    c.wait_done("cap")
    assert {r["metadata"]["finish_reason"] for r in c.rows("cap")} >= {"length"}


def test_the_hints_of_unknown_names_run_when_pasted(cluster, elsewhere):
    c = cluster()
    for args in (("stauts",), ("train-cancel", "--run", "nope"), ("train-status", "--run", "x"),
                 ("train-eval", "--run", "x")):
        result = c.manage(*args, check=False)
        assert result.returncode != 0
        pasted(c, result.stderr, elsewhere, 1)


def test_ctrl_c_stops_the_watch_not_the_job_and_says_so(cluster, tmp_path):
    """status --watch (and enqueue --follow) interrupted: not click's bare 'Aborted!', but what
    stopped (the watching), that the job goes on, and how to watch again."""
    c = cluster()  # no worker: the job stays running while it is watched
    data = write_jsonl(tmp_path / "d.jsonl", PROMPTS)
    c.manage("enqueue", "--dataset", str(data), "--job", "w")
    held = tmp_path / "watching"  # held in its loop, then interrupted there
    held.touch()
    watch = subprocess.Popen(python("manage.py", "status", "--job", "w", "--watch"),
                             env={**c.env, "DFLASH_FAILPOINTS": f"status.watching=hold:{held}"},
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: Path(f"{held}.reached").exists() or watch.poll() is not None,
                   timeout=60, what="the watch in its loop")
        watch.send_signal(signal.SIGINT)
        _, err = watch.communicate(timeout=60)
    finally:
        watch.kill()
    assert watch.returncode == 130, err
    said = " ".join(err.split())
    assert "Aborted" not in said and "Traceback" not in said, said
    assert hints_in(said) == ["manage.py status --job w --watch"], said
    assert c.status("w")["status"] == "running"
