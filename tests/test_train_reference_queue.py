"""The reference DFlash trainer launched through the queue: `manage.py train --min-rows` on rows
the simulated server is still producing, a tiny random Qwen3 as the frozen target, the loss
falling over 150 steps of a small repeated dataset, metrics in the run, in the Celery
task's state and in metrics.jsonl."""
from __future__ import annotations

import json
from pathlib import Path

from failure_support import sim_hold, sim_release
from support import wait_until
from test_train_queue import generate, queue_run, run_status, wait_run
from tiny_target import build_tiny_target

STEPS = 150


def test_reference_trainer_through_the_queue_learns_the_rows(cluster, tmp_path):
    target = build_tiny_target(tmp_path / "target", layers=3)
    config = tmp_path / "train.toml"
    config.write_text(f"""
[gate]
min_loss_tokens = 8
[reference]
target_model = "{target}"
block_size = 4
drafter_layers = 1
anchors_per_sequence = 16
decay_gamma = 4.0
learning_rate = 1e-2
max_length = 512
min_loss_tokens = 8
shuffle_buffer = 2
max_steps = {STEPS}
log_every = 10
checkpoint_every = 50
poll_s = 0.5
""")
    c = cluster(batch_rows="2", batch_max_age_s="1")
    # Six rows of 80 tokens, two at a time at 10 tokens/s: the run starts at 2 shipped rows,
    # long before the job ends, and follows it; then the six rows repeat, epoch after epoch.
    c.start_server(0, "--slots", "2", "--fixed-tokens", "80", "--decode-tps", "10")
    c.start_worker(0)
    c.start_beat()
    c.start_train_worker()
    # Held until the run is queued: on a loaded machine the two commands could take longer than
    # the first rows, and the run would start before it was ever seen waiting.
    sim_hold(c.url(0))
    generate(c, tmp_path, "ref", 6)
    run = queue_run(c, "--job", "ref", "--min-rows", "2", "--config", str(config))
    assert run_status(c, run)["status"] == "waiting"
    # Released, and held again after two more answers until the run has started following the
    # job: on a loaded machine loading the target could otherwise outlast the last rows.
    sim_hold(c.url(0), after=2)
    wait_until(lambda: any("following the job" in line for line in run_status(c, run)["log_tail"]),
               timeout=180, interval=0.2, what="the run following the job")
    sim_release(c.url(0))

    def progress_state():
        s = run_status(c, run)
        assert s["status"] in ("waiting", "queued", "running"), s
        meta = s.get("task_id") and c.r.get(f"celery-task-meta-{s['task_id']}")
        state = json.loads(meta) if meta else {}
        return state.get("status") == "PROGRESS" and (state["result"]["metrics"] or {}).get("step") \
            and (s, state)

    running, state = wait_until(progress_state, timeout=180, interval=0.2,
                                what="the run's metrics in its Celery task state")
    assert 2 <= running["gate"]["rows"] < 6  # launched on the rows shipped so far
    metrics = state["result"]["metrics"]
    assert len(metrics["accuracy_by_position"]) == 3 and metrics["tokens_per_s"] > 0

    done = wait_run(c, run, ("done", "failed", "refused", "cancelled"), timeout=600)
    assert done["status"] == "done", done
    assert c.status("ref")["status"] == "done"
    lines = [json.loads(line) for line in (Path(done["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(10, STEPS + 1, 10))
    first, last = lines[0]["loss"], sum(m["loss"] for m in lines[-3:]) / 3
    # Falling (about 0.68 of the first seen at 150 steps); test_training_reference checks the
    # trainer all the way to a drafter that predicts the target.
    assert last < 0.8 * first, [round(m["loss"], 3) for m in lines]
    assert done["metrics"]["step"] == STEPS and done["step"] == STEPS
    assert [ck["name"] for ck in done["checkpoints"]] == ["step_00000050", "step_00000100", "step_00000150"]
    assert (Path(done["checkpoints"][-1]["path"]) / "drafter.safetensors").is_file()
    result = json.loads(c.r.get(f"celery-task-meta-{done['task_id']}"))
    assert result["status"] == "SUCCESS" and result["result"]["status"] == "done"
    detail = c.manage("train-status", "--run", run).stdout
    assert "accuracy by position" in detail and f"step_{STEPS:08d}" in detail
