"""An enqueue interrupted mid-dataset (issue 42, item 3): the job keeps what was stored and runs
on it, but says it is incomplete (status, progress.json) and is never marked done; the same
enqueue again adds the rest, every prompt once, and clears it. Held, not raced: the enqueue
waits at a failpoint after its first stored chunk while the test interrupts it."""
from __future__ import annotations

import json
import signal
import subprocess

from conftest import write_jsonl
from support import ROOT, python, wait_until

from dflash_tasks.core.keys import JobName
from dflash_tasks.ledger import Ledger


def test_an_interrupted_enqueue_leaves_an_incomplete_job_that_the_same_enqueue_completes(
        cluster, tmp_path):
    c = cluster()
    rows = [{"id": f"i{i:05d}", "prompt": f"Question {i}: what of {i * 7919 % 1000}?"}
            for i in range(5000)]
    data = write_jsonl(tmp_path / "big.jsonl", rows)
    gate = tmp_path / "gate"
    gate.touch()
    enqueue = subprocess.Popen(python("manage.py", "enqueue", "--dataset", str(data), "--job",
                                      "cut"), cwd=ROOT, text=True, stderr=subprocess.PIPE,
                               stdout=subprocess.PIPE,
                               env={**c.env, "DFLASH_FAILPOINTS": f"enqueue.after_chunk=hold:{gate}"})
    wait_until(lambda: (tmp_path / "gate.reached").exists(), timeout=120,
               what="the enqueue to store its first chunk")
    enqueue.send_signal(signal.SIGINT)
    gate.unlink()
    out, err = enqueue.communicate(timeout=120)
    assert enqueue.returncode != 0
    assert "Traceback" not in err and "interrupted after" in err, err
    status = c.status("cut")
    assert 0 < status["total"] < 5000, status
    assert "interrupted after" in status["incomplete"] and "run it again" in status["incomplete"]
    assert "incomplete" in c.manage("status", "--job", "cut").stdout
    assert Ledger(c.r).finish(JobName("cut")) == "its dataset not all enqueued"

    again = c.manage("enqueue", "--dataset", str(data), "--job", "cut")
    status = c.status("cut")
    assert status["total"] == 5000 and status["incomplete"] is None, again.stdout
    assert c.r.llen("dflash:{cut}:pending") == 5000
    pending = {x.decode() for x in c.r.lrange("dflash:{cut}:pending", 0, -1)}
    assert pending == {r["id"] for r in rows}
    assert json.loads(c.manage("status", "--job", "cut", "--json").stdout)["incomplete"] is None
