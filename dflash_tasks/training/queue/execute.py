"""One training run on a training worker, from `queued` to a final status:

1. claim it (queued -> running; a second delivery, or a run cancelled meanwhile, does nothing);
2. the quality gate over the job's shipped rows; a failure refuses the run with the report;
   then, with [smoke], the overfit gate (reference trainer); a failure fails the run;
3. the trainer: the reference trainer in this process, on the streaming dataset (following the
   job while it still generates), or the command, on an export written for it;
4. its checkpoints to S3 (the reference trainer's as they appear, a command's at its end);
5. done, failed or cancelled, with exit code, duration, checkpoints and the last metrics.

All along: a heartbeat in the run (beat queues a run whose worker died again), the phase, the
latest metrics and the log's last lines in the run and in the Celery task's state (Flower), and
a stop check: `train-cancel` ends the run as cancelled, a warm shutdown of the worker hands it
back to the queue (the trainer resumes from its checkpoint on the next worker).
"""
from __future__ import annotations

import logging
import os
import shlex
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Callable

import redis

from dflash_tasks.core import jobs
from dflash_tasks.core.keys import JobName, check_job_name
from dflash_tasks.core.settings import Settings
from dflash_tasks.output.progress import read_progress
from dflash_tasks.output.storage import S3Storage, StorageError, job_output, storage_for
from dflash_tasks.training.data.reader import NoManifest, job_storage
from dflash_tasks.training.queue import checkpoints, runs, spec
from dflash_tasks.training.queue.command import LogTail, run_command
from dflash_tasks.training.reference.config import TrainConfig
from dflash_tasks.worker.shutdown import Shutdown

log = logging.getLogger(__name__)
PUBLISH_EVERY_S = 2.0
STOP_CHECK_EVERY_S = 1.0
# Besides every DFLASH_* setting, the worker's environment the trainer does not inherit.
WORKER_SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


class TrainingError(RuntimeError):
    """A run refused by the gate or failed; the message says why (also in train-status)."""


class Stopped(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class RunSession:
    def __init__(self, r: redis.Redis, run: runs.Run, settings: Settings, *,
                 publish_state: Callable[[dict], None], hostname: str, task_id: str | None = None,
                 shutdown: Shutdown | None = None):
        self.r, self.run, self.s = r, run, settings
        self.shutdown = shutdown or Shutdown()  # the worker's: a warm stop hands the run back
        self.name = run.name
        self.publish_state = publish_state
        # Owns the run while running: a task id, or a unique token when run outside Celery.
        self.hostname, self.owner = hostname, task_id or f"{hostname}:{uuid.uuid4()}"
        self.run_dir = _run_dir(settings.training_dir(), run)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.attempt = 1
        # Where its batches are: the job's own location; a job from elsewhere: ours.
        job = jobs.load(r, JobName(run.job)) if r is not None else None  # checked by _run_dir
        self.storage = job_output(job, settings) if job is not None else storage_for(settings)
        self.s3 = self.storage if isinstance(self.storage, S3Storage) else None
        self.uploaded: dict[str, str] = dict(run.get("uploaded") or {})
        self.phase = "gate"
        self.metrics: dict | None = run.get("metrics")
        self._published = 0.0
        self._stop_checked = 0.0
        self._stop_reason: str | None = None
        self._beating = threading.Event()
        self.log: LogTail | None = None

    # -- the run ---------------------------------------------------------------------------------

    def execute(self) -> dict:
        # received while this worker stops: leave it to the next one
        if self.shutdown.requested():
            runs.mark_unsent(self.r, self.name)
            return {"run": self.name, "status": runs.QUEUED, "started": False}
        if not runs.transition(self.r, self.name, (runs.QUEUED,), runs.RUNNING,
                               started_at=time.time(), worker=self.hostname, phase="gate",
                               task_id=self.owner,
                               heartbeat_at=runs.redis_now(self.r), run_dir=str(self.run_dir),
                               log_path=str(self.run_dir / "train.log")):
            current = runs.load(self.r, self.name)
            status = current.status if current else "unknown"
            log.warning("training run %s is %s, not queued: not started (a second delivery?)",
                        self.name, status)
            return {"run": self.name, "status": status, "started": False}
        self.attempt = int(self.r.hincrby(runs.train_run(self.name), "attempts", 1))
        self.log = LogTail(self.run_dir / "train.log")
        heartbeat = threading.Thread(target=self._heartbeat, name="train-heartbeat", daemon=True)
        heartbeat.start()
        started = time.monotonic()
        try:
            self.say(f"run {self.name}: job {self.run.job}, trainer {self.run.trainer}, on "
                     f"{self.hostname}, in {self.run_dir}")
            command = None if self.run.trainer == "reference" else self.allowed_command()
            rules = self.gate()
            if command is None:
                self.smoke()
                outcome = self.train_reference()
            else:
                outcome = self.train_command(rules, command)
            return self.finish(outcome, time.monotonic() - started)
        except Stopped as stop:
            return self.finish({"stopped": stop.reason}, time.monotonic() - started)
        except TrainingError:
            raise
        except Exception as exc:
            self.say(traceback.format_exc())
            self.end(runs.FAILED, error=f"{type(exc).__name__}: {exc}",
                     duration_s=round(time.monotonic() - started, 1))
            raise TrainingError(f"training run {self.name} failed: {type(exc).__name__}: {exc}") from None
        finally:
            self._beating.set()
            self.log.close()

    def allowed_command(self) -> str:
        """This node's command line for the template the run names, checked with the run's
        values; else the run is refused before anything runs. The spec comes from Redis, which
        others can write to: only what this node's own configuration allows runs here."""
        command = self.run.spec.get("command") or {}
        try:
            values = command.get("values")
            if not isinstance(values, dict):
                raise spec.SpecError("the run's spec has no [command] values")
            return spec.check_command(str(command.get("template")), values,
                                      spec.node_commands(self.s.train_templates), "the run's spec")
        except spec.SpecError as exc:
            self.end(runs.REFUSED, error=str(exc))
            raise TrainingError(f"training run {self.name} refused: {exc}") from None

    def gate(self):
        """The quality gate over what the job shipped; a failure refuses the run."""
        from dflash_tasks.training.data.exports import validate_job

        # the run's one set of rules ([rules]): the trainer and the export read the same rows
        rules = spec.run_rules(self.run.spec)
        _, thresholds = spec.gate_settings(
            {k: v for k, v in (self.run.spec.get("gate") or {}).items()
             if k not in spec.RULE_FIELDS})
        self.say(f"quality gate over job {self.run.job}'s shipped rows ...")
        try:
            report, failures = validate_job(self._job_storage(), self.run.job, rules, thresholds,
                                            heldout=self._heldout_prompts(),
                                            on_batch=lambda _rec: self.check_stop())
        except NoManifest as exc:
            report, failures = None, [str(exc)]
        figures = report.figures() if report else {}
        verdict = {"passed": not failures, "failures": failures, "rows": figures.get("rows", 0),
                   "kept": figures.get("kept"), "dropped": figures.get("dropped", {}),
                   "loss_tokens": {k: v for k, v in figures.get("loss_tokens", {}).items()
                                   if k != "distribution"},
                   # the mode the drafter learns: train-eval holds an evaluation to it
                   # (training.data.thinking.thinking_mode_mismatch(verdict, settings))
                   "thinking_mode": figures.get("thinking_mode"), "rules": figures.get("rules")}
        self._record(gate=verdict)
        if failures:
            for f in failures:
                self.say(f"  gate: {f}")
            self.end(runs.REFUSED, error="the quality gate failed: " + "; ".join(failures))
            raise TrainingError(f"training run {self.name} refused: job {self.run.job} fails the "
                                "quality gate:\n" + "\n".join(f"  - {f}" for f in failures))
        self.say(f"quality gate passed: {verdict['rows']:,} rows, {verdict['kept']:,} kept")
        return rules

    def _heldout_prompts(self) -> list:
        """The run's [eval] prompts, which the gate refuses to find among the job's rows (none
        without [eval]; a file that cannot be read fails the run where the evaluation is set up,
        `evaluator`)."""
        if not self.run.spec.get("eval"):
            return []
        from dflash_tasks.training.reference import heldout
        from dflash_tasks.training.reference.config import EvalConfig

        try:
            return heldout.load_prompts(EvalConfig.model_validate(self.run.spec["eval"]))
        except heldout.EvalError:
            return []

    def smoke(self) -> None:
        """The overfit gate, when the spec has [smoke] (once per run: a passed gate is not run
        again when the run resumes); a failure fails the run before it trains."""
        from dflash_tasks.training.reference.config import SmokeConfig
        from dflash_tasks.training.reference.smoke import SmokeFailed, failure_message, smoke_gate

        if not self.run.spec.get("smoke"):
            return
        if (self.run.get("smoke") or {}).get("passed"):
            self.say("smoke gate: passed in an earlier attempt")
            return
        config = TrainConfig.model_validate(self.run.spec.get("reference") or {})
        self.set_phase("smoke")
        try:
            verdict = smoke_gate(config, SmokeConfig.model_validate(self.run.spec["smoke"]),
                                 job=self.run.job, source=self.storage,
                                 work_dir=self.run_dir / "smoke", log=self.say,
                                 should_stop=lambda: self.check_stop(raise_=False) is not None)
            error = None if verdict["passed"] else failure_message(verdict)
        except SmokeFailed as exc:
            verdict, error = {"passed": False, "error": str(exc)}, f"the smoke gate failed: {exc}"
        self.check_stop()  # stopped while it trained: its verdict means nothing
        self._record(smoke=verdict)
        if error:
            self.end(runs.FAILED, error=error)
            raise TrainingError(f"training run {self.name} failed before training: {error}")

    def evaluator(self, config: TrainConfig) -> Callable | None:
        """With [eval] every_checkpoint, what the trainer calls after each checkpoint: tau on the
        held-out prompts, into the run's `evals`. Its inputs (prompts, tokenizer, the thinking
        contract against the job's rows) are checked now: a bad one fails the run before it
        trains, not at its first checkpoint."""
        from dflash_tasks.training.data.reader import NewestRows
        from dflash_tasks.training.data.tokens import ChatTemplate
        from dflash_tasks.training.reference import heldout
        from dflash_tasks.training.reference.config import EvalConfig

        if not self.run.spec.get("eval"):
            return None
        settings = EvalConfig.model_validate(self.run.spec["eval"])
        if not settings.every_checkpoint:
            return None
        try:
            if config.tokenizer_dir() is None:
                raise heldout.EvalError("[eval] needs a tokenizer to render its prompts: "
                                        "[reference] tokenizer, or one in the target directory")
            template = ChatTemplate.load(config.tokenizer_dir())
            prompts = heldout.load_prompts(settings)
            thinking = heldout.check_thinking_contract(
                NewestRows(self._job_storage(), self.run.job, limit=64), settings)
        except heldout.EvalError as exc:
            self.end(runs.FAILED, error=f"train-eval cannot run: {exc}")
            raise TrainingError(f"training run {self.name} failed before training: {exc}") from None
        evals: list[dict] = list(self.run.get("evals") or [])

        def on_checkpoint(path: Path, target) -> None:
            self.set_phase("eval")
            try:
                report = heldout.evaluate_checkpoint(
                    path, target, template, settings, thinking, prompts=prompts,
                    should_stop=lambda: self.check_stop(raise_=False) is not None)
                evals.append(heldout.summary(report))
                self.say(f"eval {path.name}: tau {report['tau']:.2f} over {report['steps']} "
                         f"steps of {report['prompts']} held-out prompts; acceptance by "
                         "position " + " ".join(f"{a:.2f}"
                                                for a in report["acceptance_by_position"]))
            except Exception as exc:  # an evaluation's trouble does not end days of training
                evals.append({"checkpoint": str(path), "error": f"{type(exc).__name__}: {exc}"})
                self.say(f"eval {path.name} failed: {type(exc).__name__}: {exc}")
            self._record(evals=evals)
            self.set_phase("train")

        return on_checkpoint

    def train_reference(self) -> dict:
        from dflash_tasks.training.reference import train
        from dflash_tasks.training.torch_dataset import job_finished

        config = TrainConfig.model_validate(self.run.spec.get("reference") or {})
        on_checkpoint = self.evaluator(config)
        follow = not job_finished(self._progress())
        self.set_phase("train")
        self.say(f"reference trainer: {config.max_steps} steps at most"
                 + (", following the job while it generates" if follow else ""))
        result = train(config, job=self.run.job, source=self.storage, run_dir=self.run_dir,
                       follow=follow, on_metrics=self.on_metrics,
                       should_stop=lambda: self.check_stop(raise_=False) is not None,
                       log=self.say, on_checkpoint=on_checkpoint)
        self.metrics = result.last_metrics or self.metrics
        outcome = {"step": result.step}
        if result.status == "stopped":
            outcome["stopped"] = self._stop_reason or "cancel"
        return outcome

    def train_command(self, rules, template: str) -> dict:
        from dflash_tasks.training.data.exports import export_training
        from dflash_tasks.training.queue.specforge import (
            CONFIG_FILE,
            HandoffError,
            export_rules,
            template_for,
        )

        values = self.run.spec["command"]["values"]
        fmt = values["format"]
        data_dir = self.run_dir / "data"
        rules = export_rules(rules, fmt, values)  # conversations: no truncated rows unless asked
        self.set_phase("export")
        self.say(f"exporting job {self.run.job} as {fmt} to {data_dir} ...")
        out = export_training(self._job_storage(), self.run.job, fmt, data_dir, rules,
                              on_batch=lambda _rec: self.check_stop())
        self.say(f"exported {out.kept:,} rows to {out.path}")
        if values.get("max_length") is None:  # every row whole: SpecForge's max is the longest
            values = {**values, "max_length": max(2, out.report.max_len)}
        chat_template = None
        if fmt == "specforge-conversations":
            try:
                chat_template = template_for(values.get("chat_template"), dict(out.thinking))
            except HandoffError as exc:
                self.end(runs.REFUSED, error=str(exc))
                raise TrainingError(f"training run {self.name} refused: {exc}") from None
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        run_values = {"data_path": out.path, "data_dir": data_dir, "output_dir": self.ckpt_dir,
                      "run_dir": self.run_dir, "job": self.run.job, "run": self.name,
                      "config_path": self.run_dir / CONFIG_FILE}
        if "{config_path}" in template:
            self._write_specforge_config(values, fmt, out.path, chat_template,
                                         run_values["config_path"])
        quoted = {k: shlex.quote(str(v)) for k, v in {**values, **run_values}.items()
                  if not isinstance(v, dict)}
        argv = shlex.split(spec.fill_command(template, quoted, {}))
        # The worker's secrets stay with the worker: DFLASH_REDIS_URL carries Redis's password,
        # and the trainer reads its export and leaves the upload to the worker, so it needs
        # neither that nor S3's keys (a trainer that prints its environment would put them in
        # train.log and the run's log tail). The run's env is checked (allowed_command).
        env = {**{k: v for k, v in os.environ.items()
                  if not k.startswith("DFLASH_") and k not in WORKER_SECRETS},
               **{k: str(v) for k, v in (values.get("env") or {}).items()}}
        self.set_phase("train")
        result = run_command(argv, cwd=self.run_dir, env=env, log=self.log,
                             on_progress=self._publish_tail,
                             should_stop=lambda: self.check_stop(raise_=False))
        outcome = {"exit_code": result.exit_code}
        if result.stopped:
            outcome["stopped"] = result.stopped
        return outcome

    def _write_specforge_config(self, values: dict, fmt: str, data_path: Path,
                                chat_template: str | None, path: Path) -> None:
        from dflash_tasks.training.queue import specforge

        # A run id per attempt: SpecForge deletes its own run id's checkpoints at or after the
        # step it saves, and a warm-started attempt counts its steps from 0 again.
        warm = specforge.newest_checkpoint(self.ckpt_dir)
        config = specforge.run_config(values, fmt=fmt, data_path=data_path,
                                      output_dir=self.ckpt_dir,
                                      work_dir=self.run_dir / "specforge" / f"a{self.attempt}",
                                      run_id=f"{self.name}-a{self.attempt}",
                                      chat_template=chat_template, warm_start=warm)
        specforge.write(config, path)
        data = config["data"]
        self.say(f"SpecForge run config {path}: "
                 + (f"data.prompts_path {data['prompts_path']} (the project's own input_ids and "
                    "loss_mask)" if "prompts_path" in data else
                    f"data.train_data_path {data['train_data_path']}, chat_template "
                    f"{data['chat_template']}, train_only_last_turn"))
        if warm:
            self.say(f"warm start from {warm}: its draft weights carry over; SpecForge 0.2.0 "
                     "cannot resume an online run's optimizer and schedule without its Mooncake "
                     "state, so those start again")

    def finish(self, outcome: dict, duration_s: float) -> dict:
        """Upload what the trainer left, then the run's final status (or back to the queue)."""
        if outcome.get("stopped") == "lost":
            self.say("stopped: another task runs this run now")
            return {"run": self.name, "status": "lost", **outcome}
        self.set_phase("upload")
        found = checkpoints.upload_new(self.s3, self.run.job, self.name, self.ckpt_dir,
                                       self.uploaded)
        fields = {"checkpoints": found, "uploaded": self.uploaded,
                  "duration_s": round(duration_s, 1), **{k: v for k, v in outcome.items()
                                                          if k in ("exit_code", "step")}}
        if self.metrics:
            fields["metrics"] = self.metrics
        stopped = outcome.get("stopped")
        summary = {"run": self.name, "job": self.run.job, "checkpoints": len(found), **outcome}
        if stopped == "shutdown":
            restarts = int(self.r.hincrby(runs.train_run(self.name), "restarts", 1))
            # Not sent from here: this worker still takes messages until it stops. Beat sends
            # it (launch.send_unsent) to whichever training worker is up.
            runs.transition(self.r, self.name, (runs.RUNNING,), runs.QUEUED, owner=self.owner,
                            phase="", queued_at=time.time(), unsent=1,
                            restart_reason=f"{self.hostname} shut down: handed back", **fields)
            self.say(f"worker shutting down: run handed back to the queue (restart {restarts}); "
                     "the next training worker resumes it from its last checkpoint")
            return {**summary, "status": runs.QUEUED}
        if stopped:
            self.end(runs.CANCELLED, error="cancelled (manage.py train-cancel)", **fields)
            return {**summary, "status": runs.CANCELLED}
        code = outcome.get("exit_code", 0)
        if code != 0:
            self.end(runs.FAILED, error=f"the trainer exited with code {code}", **fields)
            raise TrainingError(f"training run {self.name} failed: the trainer exited with code "
                                f"{code} (log: {self.run_dir / 'train.log'})")
        self.say(f"{len(found)} checkpoint(s)"
                 + (f", uploaded under {self.s3.location(checkpoints.s3_prefix(self.run.job, self.name))}"
                    if self.s3 else f" in {self.ckpt_dir}"))
        self.end(runs.DONE, **fields)
        return {**summary, "status": runs.DONE}

    def end(self, status: str, **fields) -> None:
        self.say(f"run {self.name}: {status}" + (f" ({fields['error']})" if "error" in fields else ""))
        runs.transition(self.r, self.name, (runs.RUNNING,), status, owner=self.owner,
                        finished_at=time.time(), phase="",
                        log_tail=self.log.tail() if self.log else [], **fields)

    # -- reporting ---------------------------------------------------------------------------------

    def say(self, line: str) -> None:
        log.info("run %s: %s", self.name, line)
        if self.log:
            for part in line.splitlines() or [""]:
                self.log.write(part)
        self._publish_tail()

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self._record(phase=phase)
        self._publish(force=True)

    def _record(self, **fields) -> None:
        """Report into the run's hash; a Redis restart must not end a days-long training (the
        next report writes the news, and the heartbeat thread keeps trying)."""
        try:
            if not runs.update(self.r, self.name, owner=self.owner, **fields):
                self._lost()
        except redis.RedisError as exc:
            log.warning("run %s: not reported to Redis (%s); training goes on", self.name, exc)

    def _lost(self) -> None:
        """Another task owns the run now (this one was given up for dead): stop, touch nothing."""
        if self._stop_reason != "lost":
            log.warning("run %s: no longer owned by this task (%s): stopping", self.name,
                        self.owner)
        self._stop_reason = "lost"

    def on_metrics(self, metrics: dict) -> None:
        self.metrics = metrics
        self.say("step {step}: loss {loss:.4f}, accuracy {accuracy:.3f}, {tokens_per_s:,.0f} "
                 "tokens/s".format(**{k: metrics.get(k) or 0 for k in
                                      ("step", "loss", "accuracy", "tokens_per_s")}))
        self._publish(force=True)
        if self.s3 is not None:  # the reference trainer renames a checkpoint into place: complete
            checkpoints.upload_new(self.s3, self.run.job, self.name, self.ckpt_dir, self.uploaded)
            self._record(uploaded=self.uploaded)

    def _publish_tail(self) -> None:
        self._publish(force=False)

    def _publish(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._published < PUBLISH_EVERY_S:
            return
        self._published = now
        tail = self.log.tail() if self.log else []
        fields = {"log_tail": tail}
        if self.metrics:
            fields["metrics"] = self.metrics
            fields["step"] = self.metrics.get("step", 0)
        self._record(**fields)
        try:
            self.publish_state({"run": self.name, "job": self.run.job, "trainer": self.run.trainer,
                                "phase": self.phase, "metrics": self.metrics,
                                "log_tail": tail[-10:]})
        except Exception as exc:  # the result backend's trouble is not the training's
            log.warning("run %s: task state not published (%s)", self.name, exc)

    # -- stopping ----------------------------------------------------------------------------------

    def check_stop(self, raise_: bool = True) -> str | None:
        """"cancel" after train-cancel, "shutdown" during a warm shutdown of the worker, "lost"
        when another task owns the run now, else None; with raise_, raises Stopped instead of returning a reason."""
        if self._stop_reason is None:
            now = time.monotonic()
            if self.shutdown.requested():
                self._stop_reason = "shutdown"
            elif now - self._stop_checked >= STOP_CHECK_EVERY_S:
                self._stop_checked = now
                try:
                    if runs.cancel_requested(self.r, self.name):
                        self._stop_reason = "cancel"
                except redis.RedisError:
                    pass  # Redis restarting: asked again in a second
        if self._stop_reason and raise_:
            raise Stopped(self._stop_reason)
        return self._stop_reason

    def _heartbeat(self) -> None:
        while not self._beating.wait(self.s.train_heartbeat_s):
            try:
                if not runs.update(self.r, self.name, owner=self.owner,
                                   heartbeat_at=runs.redis_now(self.r)):
                    self._lost()
            except redis.RedisError as exc:  # a Redis restart: the next beat tries again
                log.warning("run %s: heartbeat not written: %s", self.name, exc)

    # -- data ----------------------------------------------------------------------------------------

    def _job_storage(self):
        return job_storage(self.storage, self.run.job)

    def _progress(self) -> dict | None:
        try:
            return read_progress(self._job_storage(), self.run.job)
        except StorageError:
            return None


def _run_dir(root: Path, run: runs.Run) -> Path:
    """root/<run>, with the run's names as manage.py train checked them: the run comes from
    Redis, which others write to, and its data/ and checkpoints/ must stay under root."""
    for what, name in (("run", run.name), ("job", run.job)):
        try:
            check_job_name(str(name))
        except ValueError as exc:
            raise TrainingError(f"training run refused: its {what} name: {exc}") from None
    path = root / run.name
    if os.path.normpath(path).rsplit(os.sep, 1)[0] != os.path.normpath(root):
        raise TrainingError(f"training run refused: {path} is not directly under {root}")
    return path
