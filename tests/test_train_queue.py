"""Training runs through the queue: `manage.py train` -> beat -> the `train` queue -> a training
worker -> the quality gate -> a trainer; train-status, train-cancel, a warm shutdown's handback.
The external trainer is tests/command_trainer.py; the reference trainer is in
test_train_reference_queue.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_jsonl
from s3support import BUCKET, s3_cluster
from specforge.config import load_config
from support import ROOT, hints_in, paste, python, wait_until
from test_training_data import good_row, six_token_row, write_batches
from tokenizer_support import build_tokenizer

from dflash_dev.sim import tokens as sim
from dflash_tasks.core.keys import JobName
from dflash_tasks.training.queue import runs

# Short, varied lengths: every row finishes, none is short, no one length dominates.
SIM_ARGS = ("--slots", "16", "--median-tokens", "120", "--p-over-4096", "0.001",
            "--decode-tps", "4000")
GATE = '[gate]\nmin_loss_tokens = 8\n'


def trainer_command(mode: str) -> str:
    return f"{sys.executable} {ROOT / 'tests' / 'command_trainer.py'} {mode} --data {{data_path}} " \
           "--out {output_dir}"


def node_templates(tmp_path: Path, extra: str = "") -> str:
    """The training node's DFLASH_TRAIN_TEMPLATES file: the stand-in trainer's modes by name (a
    run names one; the node holds the command line)."""
    lines = ["[templates]", *(f"{mode} = {json.dumps(trainer_command(mode))}"
                              for mode in ("ok", "fail", "hang")), extra]
    return str(write_text(tmp_path / "node-templates.toml", "\n".join(lines) + "\n"))


def run_status(c, run: str) -> dict:
    return json.loads(c.manage("train-status", "--run", run, "--json").stdout)


def wait_run(c, run: str, statuses: tuple[str, ...], timeout: float = 120) -> dict:
    return wait_until(lambda: (s := run_status(c, run))["status"] in statuses and s,
                      timeout=timeout, interval=0.3, what=f"run {run} to be {'/'.join(statuses)}")


def queue_run(c, *args: str) -> str:
    return json.loads(c.manage("train", *args, "--json").stdout)["run"]


def generate(c, tmp_path: Path, job: str, n: int) -> None:
    path = write_jsonl(tmp_path / f"{job}.jsonl",
                       [{"id": f"{job}{i:03d}", "prompt": f"w{i} w{i * 3} w{i + 11}"} for i in range(n)])
    c.manage("enqueue", "--dataset", str(path), "--job", job, "--gpus", "1",
             "--max-output-tokens", "4096")


def test_command_trainer_after_done_uploads_its_checkpoint_and_records_failures(cluster, tmp_path, moto):
    c = s3_cluster(cluster, moto.url, batch_rows="10", batch_max_age_s="1",
                   train_templates=node_templates(tmp_path))
    config = write_text(tmp_path / "train.toml", GATE)
    c.start_server(0, *SIM_ARGS)
    c.start_worker(0)
    c.start_beat()
    c.start_train_worker()
    generate(c, tmp_path, "cmd", 40)
    run = queue_run(c, "--job", "cmd", "--after-done", "--trainer", "command",
                    "--template", "ok", "--config", str(config))

    done = wait_run(c, run, ("done", "failed", "refused"), timeout=240)
    assert done["status"] == "done", done
    assert c.status("cmd")["status"] == "done"  # launched only once the job was done
    assert done["gate"]["passed"] and done["gate"]["rows"] == 40
    assert int(done["exit_code"]) == 0 and float(done["duration_s"]) > 0
    log = Path(done["log_path"]).read_text()
    assert f"read {done['gate']['kept']} rows from tokenized.jsonl" in log  # the export
    assert any("saved checkpoint" in line for line in done["log_tail"])
    [ckpt] = done["checkpoints"]
    assert ckpt["name"] == "step_5" and ckpt["step"] == 5
    assert ckpt["uri"] == f"s3://{BUCKET}/runs/cmd/training/{run}/checkpoints/step_5"
    listed = moto.client().list_objects_v2(Bucket=BUCKET, Prefix=f"runs/cmd/training/{run}/")
    names = sorted(o["Key"].rsplit("/", 1)[1] for o in listed["Contents"])
    assert names == ["config.json", "weights.bin"]
    weights = moto.client().get_object(
        Bucket=BUCKET, Key=f"runs/cmd/training/{run}/checkpoints/step_5/weights.bin")["Body"].read()
    assert weights == (Path(ckpt["path"]) / "weights.bin").read_bytes()

    # A trainer that fails: the run fails with its exit code, and its log says why.
    # Given as the command line itself, it is the node's template `fail`, and named so.
    failing = queue_run(c, "--job", "cmd", "--trainer", "command", "--command",
                        trainer_command("fail"), "--config", str(config))
    assert runs.load(c.r, failing).spec["command"]["template"] == "fail"
    failed = wait_run(c, failing, ("done", "failed"))
    assert failed["status"] == "failed" and int(failed["exit_code"]) == 3
    assert "exited with code 3" in failed["error"]
    assert any("CUDA out of memory" in line for line in failed["log_tail"])
    c.env["COLUMNS"] = "200"  # rich's width when not on a terminal
    table = c.manage("train-status").stdout
    assert run in table and failing in table and "failed" in table


def test_a_run_survives_a_drain_a_crash_and_a_stall_then_is_cancelled(cluster, tmp_path):
    c = cluster(train_heartbeat_s="0.5", train_stale_s="3", train_templates=node_templates(tmp_path))
    write_batches(c.output_dir, "ready", [good_row(i) for i in range(30)])  # shipped elsewhere
    config = write_text(tmp_path / "train.toml", GATE)
    worker = c.start_train_worker()
    c.start_beat()  # sends the run again after the handback
    run = queue_run(c, "--job", "ready", "--trainer", "command", "--template", "hang",
                    "--config", str(config))
    pid_file = c.output_dir / "training" / run / "checkpoints" / "trainer.pid"
    wait_until(pid_file.exists, timeout=60, what="the trainer to start")
    first_pid = int(pid_file.read_text())
    assert run_status(c, run)["status"] == "running"

    # TERM to the worker (a node being drained): the trainer is stopped, the run queued again.
    worker.stop()
    assert not pid_alive(first_pid)
    back = run_status(c, run)
    assert back["status"] == "queued" and back["restarts"] == 1 and back["attempts"] == 1, back
    assert "shut down" in back["restart_reason"]
    pid_file.unlink()
    c.start_train_worker()  # the next worker takes it from the queue
    wait_until(pid_file.exists, timeout=60, what="the run to start again on the new worker")
    second_pid = int(pid_file.read_text())
    assert run_status(c, run)["attempts"] == 2

    # SIGKILL to that worker (a crash): its trainer dies with it, the heartbeat stops, beat
    # queues the run again and the next worker takes it.
    c.train_workers[-1].kill()
    wait_until(lambda: not pid_alive(second_pid), timeout=10, what="the orphaned trainer to die")
    pid_file.unlink()
    c.start_train_worker()
    wait_until(pid_file.exists, timeout=60, what="the run to be queued again and start")
    third_pid = int(pid_file.read_text())
    again = run_status(c, run)
    assert again["attempts"] == 3 and again["restarts"] == 2
    assert "no heartbeat" in again["restart_reason"]

    # SIGSTOP to that worker (a node frozen, a long GC pause): given up for dead, the run goes to
    # a fourth worker; when the frozen one wakes up it finds the run is no longer its own and
    # stops its trainer, instead of two trainers competing.
    stalled = c.train_workers[-1]
    os.kill(stalled.pid, signal.SIGSTOP)
    pid_file.unlink()
    c.start_train_worker()
    wait_until(pid_file.exists, timeout=60, what="the run to move to a fourth worker")
    fourth_pid = int(pid_file.read_text())
    os.kill(stalled.pid, signal.SIGCONT)
    wait_until(lambda: not pid_alive(third_pid), timeout=30,
               what="the woken worker to stop its trainer")
    owned = run_status(c, run)
    assert owned["status"] == "running" and owned["attempts"] == 4 and pid_alive(fourth_pid)
    assert "no longer owned by this task" in stalled.log()

    out = c.manage("train-cancel", "--run", run).stdout
    assert "cancel requested" in out
    cancelled = wait_run(c, run, ("cancelled",), timeout=60)
    assert "train-cancel" in cancelled["error"]
    assert not pid_alive(fourth_pid)
    assert any("SIGTERM" in line for line in cancelled["log_tail"])
    assert "already cancelled" in c.manage("train-cancel", "--run", run).stdout


def test_the_quality_gate_refuses_a_bad_dataset(cluster, tmp_path):
    c = cluster(train_templates=node_templates(tmp_path))
    write_batches(c.output_dir, "six", [six_token_row(i) if i % 10 else good_row(i)
                                        for i in range(200)])
    c.start_train_worker()
    run = queue_run(c, "--job", "six", "--trainer", "command", "--template", "ok")
    refused = wait_run(c, run, ("refused", "done", "failed"))
    assert refused["status"] == "refused"
    assert refused["gate"]["passed"] is False
    assert any("loss-mask spike" in f for f in refused["gate"]["failures"])
    assert "quality gate failed" in refused["error"]
    assert not (c.output_dir / "training" / run / "checkpoints").exists()  # never ran
    detail = c.manage("train-status", "--run", run).stdout
    assert "FAILED" in detail and "loss-mask spike" in detail


def test_validate_and_the_training_gate_give_one_answer(cluster, tmp_path):
    """`validate --config` applies the training run's own rules and limits (issue 42, item 3):
    the same rows and config get one verdict, with the same reasons. validate used to keep
    its own defaults (max_length 16384), so rows the gate refused for their length passed."""
    c = cluster(train_templates=node_templates(tmp_path))
    write_batches(c.output_dir, "mixed", [good_row(i) for i in range(200)])
    c.start_train_worker()
    strict = write_text(tmp_path / "strict.toml", "[rules]\nmax_length = 1500\nlong_rows = \"drop\"\n")
    for config, passes in (((), True), (("--config", str(strict)), False)):
        checked = c.manage("validate", "--job", "mixed", "--trainer", "command", "--json", *config,
                           check=False)
        verdict = json.loads(checked.stdout)
        run = queue_run(c, "--job", "mixed", "--trainer", "command", "--template", "ok", *config)
        gate = wait_run(c, run, ("refused", "done", "failed"))["gate"]
        assert (verdict["passed"], gate["passed"], checked.returncode) == (passes, passes,
                                                                         0 if passes else 1)
        assert verdict["failures"] == gate["failures"], (verdict["failures"], gate["failures"])
        assert verdict["kept"] == gate["kept"] and verdict["rules"] == gate["rules"]
    assert any("too long" in f for f in verdict["failures"]), verdict["failures"]
    # With a training worker alive, a queued run does not say it waits for one.
    queued = json.loads(c.manage("train", "--job", "mixed", "--trainer", "command", "--template",
                                 "ok", "--json").stdout)
    assert "waits" not in queued, queued
    wait_run(c, queued["run"], ("done", "failed"))
    # An option still overrides the config, and says it is not the training gate any more.
    loose = c.manage("validate", "--job", "mixed", "--trainer", "command", "--config", str(strict),
                     "--max-length", "4096")
    assert "not the training gate: --max-length 4096 (the training gate's: 1500)" in loose.stderr


def test_the_training_node_runs_only_the_templates_and_env_it_allows(cluster, tmp_path):
    """A run's spec comes from Redis, which others can write to: what a Redis writer queues
    (a command line of its own, an env that loads code) is refused by the node, with the reason,
    before anything runs: no gate, no export, no process."""
    c = cluster(train_templates=node_templates(tmp_path))
    write_batches(c.output_dir, "job", [good_row(i) for i in range(30)])
    c.start_train_worker()
    marker = tmp_path / "pwned"
    values = {"format": "specforge-tokenized"}
    written = {  # spec["command"] as a Redis writer would store it, and why it is refused
        "raw": ({"template": f"touch {marker}", "values": values},
                f"template 'touch {marker}' is not one this training node runs"),
        "preload": ({"template": "ok", "values": {**values, "env": {"LD_PRELOAD": str(marker)}}},
                    "LD_PRELOAD may not be set by a run"),
        "remote": ({"template": "ok", "values": {
            **values, "specforge": {"model": {"trust_remote_code": True}}}},
                   "trust_remote_code: not from a run's spec"),
    }
    for name, (command, _) in written.items():
        runs.create(c.r, JobName("job"), "command", {"trainer": "command", "gate": {}, "command": command},
                    trigger="now", name=f"job-{name}")
        subprocess.run(python("-c", f"from dflash_tasks.tasks.train import send; send('job-{name}')"),
                       env=c.env, check=True, cwd=ROOT)
    for name, (_, reason) in written.items():
        refused = wait_run(c, f"job-{name}", ("refused", "done", "failed"))
        assert refused["status"] == "refused", refused
        assert reason in refused["error"], refused["error"]
        assert "gate" not in refused and refused["log_tail"]  # refused before the gate
        assert not (Path(refused["run_dir"]) / "data").exists()
    assert not marker.exists()


def test_train_rejects_bad_input_before_queueing(cluster, tmp_path):
    c = cluster(train_templates=node_templates(tmp_path, 'lr = "train --lr {lr}"'))
    write_batches(c.output_dir, "ok", [good_row(i) for i in range(5)])
    bad_field = write_text(tmp_path / "bad.toml", "[gate]\nmin_loss_tokenz = 3\n")
    result = c.manage("train", "--job", "ok", "--config", str(bad_field), check=False)
    assert result.returncode == 2 and "min_loss_tokenz" in result.stderr
    assert str(bad_field) in result.stderr.replace("\n", "")
    bad_type = write_text(tmp_path / "type.toml", '[reference]\ntarget_model = "/m"\nblock_size = "big"\n')
    result = c.manage("train", "--job", "ok", "--config", str(bad_type), check=False)
    assert result.returncode == 2 and "block_size" in result.stderr
    result = c.manage("train", "--job", "ok", "--trainer", "command", check=False)
    assert result.returncode == 2 and "target_model: required" in result.stderr
    result = c.manage("train", "--job", "ok", "--trainer", "command", "--template", "lr",
                      check=False)
    assert result.returncode == 2 and "{lr}" in result.stderr
    # Only the command lines the node's templates hold, and only the env it allows.
    result = c.manage("train", "--job", "ok", "--trainer", "command", "--template", "evil",
                      check=False)
    assert result.returncode == 2 and "template 'evil' is not one this training node runs" \
        in result.stderr.replace("\n", " ")
    result = c.manage("train", "--job", "ok", "--trainer", "command", "--command",
                      "touch /tmp/x {data_path}", check=False)
    assert result.returncode == 2 and "not a command line this training node runs" \
        in result.stderr.replace("\n", " ")
    preload = write_text(tmp_path / "preload.toml", '[command]\nenv = { LD_PRELOAD = "/x.so" }\n')
    result = c.manage("train", "--job", "ok", "--trainer", "command", "--template", "ok",
                      "--config", str(preload), check=False)
    assert result.returncode == 2 and "LD_PRELOAD may not be set by a run" in result.stderr
    result = c.manage("train", "--job", "nope", "--trainer", "command", "--template", "ok",
                      check=False)
    assert result.returncode == 1 and "no manifest" in result.stderr
    result = c.manage("train", "--job", "nope", "--after-done", "--trainer", "command",
                      "--template", "ok", check=False)
    assert result.returncode == 1 and "no job named 'nope'" in result.stderr
    assert json.loads(c.manage("train-status", "--json").stdout) == []  # nothing was queued


def plain_row(i: int) -> dict:
    """A row generated with thinking off: the empty think block is in the prompt."""
    row = good_row(i)
    row["id"] = f"plain{i:04d}"
    row["metadata"]["enable_thinking"] = False
    row["conversations"][-1]["reasoning_content"] = None
    answer = [int(w[1:]) for w in row["conversations"][-1]["content"].split()] + [sim.IM_END]
    row["token_ids"] = {"prompt": sim.render_chat(row["conversations"][:1], False),
                        "response": answer}
    row["metadata"]["completion_tokens"] = len(answer)
    return row


def test_the_default_command_hands_specforge_the_tokenized_export(cluster, tmp_path):
    """The default command: `specforge train --config <run_dir>/specforge.json`, the config
    written from [command], read by SpecForge's own loaders (tests/fake_specforge.py)."""
    c = cluster()
    rows = [good_row(i) for i in range(30)]
    write_batches(c.output_dir, "sf", rows)
    write_batches(c.output_dir, "mixed", [good_row(i) for i in range(20)]
                  + [plain_row(i) for i in range(20)])
    fake = tmp_path / "bin" / "specforge"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} {ROOT / 'tests' / 'fake_specforge.py'} "
                    '"$@"\n')
    fake.chmod(0o755)
    # The node points its built-in `specforge` template at another binary.
    c.env["DFLASH_TRAIN_TEMPLATES"] = str(write_text(
        tmp_path / "node.toml", f'[templates]\nspecforge = "{fake} train --config {{config_path}}"\n'))
    command = (f'[command]\ntarget_model = "{build_tokenizer(tmp_path / "tok")}"\n'
               'learning_rate = 3e-4\nepochs = 2\n')
    config = write_text(tmp_path / "train.toml", GATE + command)
    c.start_train_worker()
    run = queue_run(c, "--job", "sf", "--trainer", "command", "--config", str(config))

    done = wait_run(c, run, ("done", "failed", "refused"))
    assert done["status"] == "done", done
    run_dir = Path(done["run_dir"])
    cfg = load_config(str(run_dir / "specforge.json"))
    assert cfg.data.prompts_path == str(run_dir / "data" / "tokenized.jsonl")
    assert (cfg.training.learning_rate, cfg.training.num_epochs) == (3e-4, 2)
    assert cfg.output_dir == str(run_dir / "checkpoints") and cfg.run_id == f"{run}-a1"
    seen = json.loads((run_dir / "seen.json").read_text())
    ours = {r["id"]: r["token_ids"] for r in rows}
    exported = [json.loads(x)["id"]
                for x in (run_dir / "data" / "tokenized.jsonl").read_text().splitlines()]
    assert len(seen) == len(exported) == 30
    for rid, sample in zip(exported, seen):  # what SpecForge trains on is the server's ids
        assert sample["input_ids"] == ours[rid]["prompt"] + ours[rid]["response"]
        prompt, response = ours[rid]["prompt"], ours[rid]["response"]
        assert sample["loss_mask"] == [0] * len(prompt) + [1] * len(response)
    assert [ck["name"] for ck in done["checkpoints"]] == [f"{run}-a1-step5"]  # not the -latest link

    # Conversations, asked for: the thinking job gets SpecForge's qwen3-thinking template and
    # train_only_last_turn; a job mixing modes is refused by the gate (one thinking mode per
    # run, whatever the format), with the reason, before training.
    conv = write_text(tmp_path / "conv.toml",
                      GATE + command + 'format = "specforge-conversations"\n')
    thinking = wait_run(c, queue_run(c, "--job", "sf", "--trainer", "command", "--config",
                                     str(conv)), ("done", "failed", "refused"))
    assert thinking["status"] == "done", thinking
    cfg = load_config(str(Path(thinking["run_dir"]) / "specforge.json"))
    assert (cfg.data.chat_template, cfg.data.train_only_last_turn) == ("qwen3-thinking", True)
    assert cfg.data.train_data_path.endswith("conversations.jsonl") and not cfg.data.prompts_path
    mixed = wait_run(c, queue_run(c, "--job", "mixed", "--trainer", "command", "--config",
                                  str(conv)), ("done", "failed", "refused"))
    assert mixed["status"] == "refused", mixed
    assert "enable_thinking differs across the rows" in mixed["error"]
    assert "True in 20 rows" in mixed["error"] and "False in 20 rows" in mixed["error"]
    assert not (Path(mixed["run_dir"]) / "checkpoints").exists()


def write_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("trigger", [[], ["--after-done"], ["--min-rows", "10"]])
def test_train_prints_its_run_for_every_trigger(tmp_path, redis_url, trigger):
    """The README's three forms, without --json: each creates one run and says when it starts
    (the message used to format min_rows when it was None, after the run was created)."""
    from conftest import Cluster, write_jsonl

    c = Cluster(tmp_path, redis_url, train_templates=node_templates(tmp_path))
    data = write_jsonl(tmp_path / "d.jsonl",
                       [{"id": "a", "messages": [{"role": "user", "content": "hi"}]}])
    c.manage("enqueue", "--dataset", str(data), "--job", "tj")
    out = c.manage("train", "--job", "tj", "--trainer", "command", "--template", "ok", *trigger)
    assert "training run" in out.stdout and "tj-train-1" in out.stdout, out.stdout
    assert c.r.zcard("dflash:train:runs") == 1
    # No training worker runs here: a run queued now says it waits for one, and so does
    # train-status while it waits (a run that waits for its trigger is not in the queue yet).
    alone = "no training worker answers"
    assert (alone in out.stderr) is (not trigger), out.stderr
    assert (alone in c.manage("train-status", "--run", "tj-train-1").stdout) is (not trigger)
    assert (alone in c.manage("train-status").stderr) is (not trigger)
    listed = json.loads(c.manage("train-status", "--json").stdout)
    assert (alone in listed[0].get("waits", "")) is (not trigger)
    # Its hints work when pasted from any directory (the worker, which runs until stopped, as
    # far as its --help).
    hints = hints_in(out.stdout)
    assert hints == ["manage.py worker --queue train", "manage.py train-status --run tj-train-1"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for hint in hints:
        result = paste(hint, c.env, elsewhere)
        assert result.returncode == 0 and "Traceback" not in result.stderr, (hint, result.stderr)
