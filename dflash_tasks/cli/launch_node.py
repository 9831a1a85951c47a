"""`launch_node.py`: what runs on a GPU node: one SGLang server per GPU, one Celery worker per server, supervised.

    python workers/launch_node.py --gpus 0,1,2 --model-path /models/Qwen3-8B
    python workers/launch_node.py --gpus 0,1 --simulate            # no GPU, no sglang needed
    python workers/launch_node.py --node b --gpus 0,1 --model-path /models/Qwen3-8B  # node b

For each GPU I (in the order given):

1. start its server on port BASE+I, with CUDA_VISIBLE_DEVICES=I:

       python -m sglang.launch_server --model-path M --port BASE+I --host 127.0.0.1
           --reasoning-parser qwen3 --max-running-requests N --mem-fraction-static F
           --enable-metrics [--speculative-* ...] [--extra-sglang-args ...]

   --model-path             the model; it is also the served model name clients must send.
   --port BASE+I            the layout the workers assume by default (settings.sglang_url_for).
   --host 127.0.0.1         only the colocated worker talks to it; nothing else on the network.
   --reasoning-parser qwen3 the server splits Qwen3's thinking into `reasoning_content`, apart from
                            `content`: the rows keep the two apart for the drafter's training.
   --max-running-requests N the server's decode slots (64 by default). The worker reads it back
                            from /server_info and sets its concurrency a little above it, so every
                            slot stays busy and the server's own queue stays short.
   --mem-fraction-static F  GPU memory for weights + KV cache (0.88): a larger KV pool keeps N long
                            thinking generations (8K tokens each) resident without retractions.
   --enable-metrics         /metrics in Prometheus form: per-GPU generation throughput, running
                            and queued requests, speculative accept length, for dashboards.
   --speculative-*          passed through as given (e.g. a DFlash or EAGLE drafter).

   With --simulate it starts the project's simulated server instead, `python manage.py sim-server
   --host H --port BASE+I --slots N [--model-name M] [--sim-args ...]`; sglang is never imported.

2. wait for its /health to answer 200 (a fresh connection per probe: SGLang closes idle
   keep-alive connections after 5 s), then start its worker:
   `python manage.py worker --gpu I --node NAME --sglang-url http://127.0.0.1:BASE+I`
   (--no-workers: none). Its GPU is named gpuI@NAME, and so are its queue and Celery worker: the
   GPU 0 of every node is its own, and a node joins a running job by starting.

3. supervise, until SIGTERM or SIGINT:
   - a server process that exits (SGLang's watchdog and its KV-pool leak check kill the whole
     server) is restarted after an exponential backoff (--restart-backoff doubling up to
     --restart-backoff-max; it starts over once a process has run --stable-seconds);
   - /health answers 503 while a server starts and while a long prefill delays the probe, so a
     single failure means nothing: only --unhealthy-after consecutive failures, --health-interval
     apart, declare a running server dead (it is then killed and restarted). A server that is not
     healthy --startup-timeout seconds after its start is restarted too;
   - a worker that exits is restarted with the same backoff. A server restart leaves its worker
     alone: the worker treats a dead server as transient and waits for /health.

   SIGTERM/SIGINT: the workers are stopped first (SIGTERM: Celery's warm shutdown, which lets
   in-flight generations finish, up to --worker-stop-timeout), then the servers (SIGTERM to the
   process group, then SIGKILL after --server-stop-timeout). A second signal kills at once.

Every child runs in its own session (process group): Ctrl-C on the terminal reaches only the
launcher, which stops the children in order, and a server's helper processes (SGLang's scheduler
and detokenizer) are killed with it, so no orphan keeps holding GPU memory.

Logs: one file per process in --log-dir (gpuI-server.log, gpuI-worker.log, appended across
restarts with a header line per start), and one line per event on stdout (also in
launch_node.log). --status-file (default LOG_DIR/launch_node.json) holds the current pids,
ports, states and restart counts as JSON, rewritten atomically on every event.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx

from dflash_tasks.core.keys import check_node_name
from dflash_tasks.core.settings import get_settings

# manage.py's commands, by module: the installed package's, wherever this runs from.
MANAGE = [sys.executable, "-m", "dflash_tasks.cli"]
TICK_S = 0.2           # supervision loop period
STARTUP_PROBE_S = 1.0  # /health probe period while a server starts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        allow_abbrev=False,  # or --speculative-draft-model would be read as ...-model-path
        description="Start and supervise one SGLang server and one Celery worker per GPU. "
                    "Any other --speculative-* option is passed to SGLang as given.")
    p.add_argument("--gpus", metavar='LIST|auto', required=True,
                   help="GPU indices, comma-separated: 0,1,2; auto: the node's allocation "
                        "(CUDA_VISIBLE_DEVICES, else SLURM_GPUS_ON_NODE, else nvidia-smi's GPUs).")
    p.add_argument("--node", metavar='NAME',
                   help="This node's name, unique in the deployment: its GPUs are gpuI@NAME "
                        "[DFLASH_NODE, else Slurm's SLURMD_NODENAME, else the host's short name].")
    p.add_argument("--model-path", metavar='PATH', help="Model directory or hub id (required unless --simulate).")
    p.add_argument("--base-port", metavar='PORT', type=int, default=get_settings().sglang_base_port,
                   help="GPU I serves on BASE+I [DFLASH_SGLANG_BASE_PORT, else 30000].")
    p.add_argument("--host", metavar='ADDR', default="127.0.0.1", help="Servers' listen address [127.0.0.1].")
    p.add_argument("--max-running-requests", metavar='N', type=int, default=64,
                   help="Decode slots per server; the worker's concurrency follows [64].")
    p.add_argument("--mem-fraction-static", metavar='F', type=float, default=0.88, help="[0.88]")
    p.add_argument("--speculative-algorithm", metavar='NAME', help="e.g. EAGLE3 or DFLASH (passed to SGLang).")
    p.add_argument("--speculative-draft-model-path", metavar='PATH', help="Drafter model (passed to SGLang).")
    p.add_argument("--extra-sglang-args", metavar='"ARGS"', default="", help='More SGLang flags, one string: "--a 1 --b".')
    p.add_argument("--sglang-python", metavar='PYTHON', default=sys.executable,
                   help="Interpreter with sglang installed [this one].")
    p.add_argument("--simulate", action="store_true",
                   default=get_settings().simulate,
                   help="Start the project's simulated server (manage.py sim-server) instead "
                        "[DFLASH_SIMULATE=1: a deployment's own commands, without GPUs].")
    p.add_argument("--sim-args", metavar='"ARGS"', default=get_settings().sim_args,
                   help='More sim-server flags, one string [DFLASH_SIM_ARGS].')
    p.add_argument("--no-workers", action="store_true", help="Servers only, no Celery workers.")
    p.add_argument("--log-dir", metavar='DIR', type=Path, default=Path("output/logs"), help="[./output/logs]")
    p.add_argument("--status-file", metavar='FILE', type=Path, help="JSON state of every process [LOG_DIR/launch_node.json].")
    p.add_argument("--health-interval", metavar='S', type=float, default=10.0,
                   help="Seconds between /health probes of a running server [10].")
    p.add_argument("--health-timeout", metavar='S', type=float, default=20.0, help="Per probe [20].")
    p.add_argument("--unhealthy-after", metavar='N', type=int, default=12,
                   help="Consecutive failed probes that declare a running server dead [12].")
    p.add_argument("--startup-timeout", metavar='S', type=float, default=1800.0,
                   help="Seconds for a server to become healthy before it is restarted [1800].")
    p.add_argument("--restart-backoff", metavar='S', type=float, default=2.0, help="First restart delay, s [2].")
    p.add_argument("--restart-backoff-max", metavar='S', type=float, default=120.0, help="Cap on the delay, s [120].")
    p.add_argument("--stable-seconds", metavar='S', type=float, default=300.0,
                   help="A process up this long starts its backoff over [300].")
    p.add_argument("--worker-stop-timeout", metavar='S', type=float, default=300.0,
                   help="Warm-shutdown wait for workers before SIGKILL [300].")
    p.add_argument("--server-stop-timeout", metavar='S', type=float, default=60.0,
                   help="Wait for servers after SIGTERM before SIGKILL [60].")
    args, rest = p.parse_known_args(argv)

    # The other --speculative-* flags SGLang knows (num-steps, eagle-topk, num-draft-tokens, ...)
    # pass through untouched; anything else unknown is a typo.
    args.speculative_rest = rest
    for token in rest:
        if token.startswith("-") and not token.startswith("--speculative-"):
            p.error(f"unrecognized argument: {token}")
    if rest and not rest[0].startswith("--speculative-"):
        p.error(f"unrecognized argument: {rest[0]}")
    try:
        args.gpu_list = allocated_gpus() if args.gpus == "auto" else \
            [int(g) for g in args.gpus.split(",") if g.strip()]
    except ValueError:
        p.error(f"--gpus must be comma-separated integers or auto, not {args.gpus!r}")
    except LookupError as exc:
        p.error(f"--gpus auto: {exc}")
    if not args.gpu_list or len(set(args.gpu_list)) != len(args.gpu_list) or min(args.gpu_list) < 0:
        p.error(f"--gpus needs distinct non-negative indices, not {args.gpus!r}")
    try:
        args.node = check_node_name(args.node) if args.node else get_settings().node
    except ValueError as exc:
        p.error(f"--node: {exc}")
    if not args.simulate and not args.model_path:
        p.error("--model-path is required (or --simulate)")
    if not args.simulate and not shutil.which(args.sglang_python):
        p.error(f"--sglang-python {args.sglang_python!r} not found")
    args.status_file = args.status_file or args.log_dir / "launch_node.json"
    return args


def allocated_gpus(environ=os.environ) -> list[int]:
    """The GPUs this node was given, as a cluster gives them: the CUDA_VISIBLE_DEVICES its
    scheduler set (Slurm's gres; indices), else SLURM_GPUS_ON_NODE (a count), else every GPU
    nvidia-smi lists (a Kubernetes pod sees only those it asked for). A CUDA_VISIBLE_DEVICES of
    UUIDs (MIG, some device plugins) names no index: its count is used, numbered from 0."""
    visible = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        items = [v.strip() for v in visible.split(",") if v.strip()]
        return [int(v) for v in items] if all(v.isdigit() for v in items) \
            else list(range(len(items)))
    count = environ.get("SLURM_GPUS_ON_NODE", "").strip()
    if count.isdigit() and int(count) > 0:
        return list(range(int(count)))
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        listed = ""
    found = [line for line in listed.splitlines() if line.startswith("GPU ")]
    if not found:
        raise LookupError("no GPU in CUDA_VISIBLE_DEVICES or SLURM_GPUS_ON_NODE, and nvidia-smi "
                          "lists none: ask the scheduler for GPUs (--gpus-per-node, "
                          "nvidia.com/gpu) or name them (--gpus 0,1)")
    return list(range(len(found)))


def speculative_args(args: argparse.Namespace) -> list[str]:
    out = []
    if args.speculative_algorithm:
        out += ["--speculative-algorithm", args.speculative_algorithm]
    if args.speculative_draft_model_path:
        out += ["--speculative-draft-model-path", args.speculative_draft_model_path]
    return out + list(args.speculative_rest)


def server_command(args: argparse.Namespace, gpu: int) -> list[str]:
    port = str(args.base_port + gpu)
    if args.simulate:
        cmd = [*MANAGE, "sim-server", "--host", args.host, "--port", port,
               "--slots", str(args.max_running_requests)]
        if args.model_path:
            cmd += ["--model-name", args.model_path]
        return cmd + shlex.split(args.sim_args)
    return [args.sglang_python, "-m", "sglang.launch_server",
            "--model-path", args.model_path, "--port", port, "--host", args.host,
            "--reasoning-parser", "qwen3",
            "--max-running-requests", str(args.max_running_requests),
            "--mem-fraction-static", str(args.mem_fraction_static),
            "--enable-metrics",
            *speculative_args(args), *shlex.split(args.extra_sglang_args)]


def server_url(args: argparse.Namespace, gpu: int) -> str:
    return f"http://127.0.0.1:{args.base_port + gpu}"


def worker_command(args: argparse.Namespace, gpu: int) -> list[str]:
    return [*MANAGE, "worker", "--gpu", str(gpu), "--node", args.node,
            "--sglang-url", server_url(args, gpu)]


@dataclass
class Child:
    """One supervised process (a server or a worker) and its restart bookkeeping."""
    gpu: int
    kind: str                      # "server" or "worker"
    log_path: Path
    popen: subprocess.Popen | None = None
    state: str = "idle"            # idle, starting, healthy, backoff, stopped (servers); running (workers)
    started_at: float = 0.0
    restart_at: float = 0.0
    failures: int = 0              # consecutive short-lived runs: drives the backoff
    starts: int = 0
    health_fails: int = 0
    next_probe: float = 0.0
    probe: Future | None = None
    healthy_once: bool = False
    last_probe: str = ""

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclass
class Launcher:
    args: argparse.Namespace
    servers: dict[int, Child] = field(default_factory=dict)
    workers: dict[int, Child] = field(default_factory=dict)
    signals: int = 0

    def __post_init__(self) -> None:
        self.args.log_dir.mkdir(parents=True, exist_ok=True)
        self._events = open(self.args.log_dir / "launch_node.log", "a", buffering=1)
        self._probes = ThreadPoolExecutor(max_workers=len(self.args.gpu_list),
                                          thread_name_prefix="health")
        for gpu in self.args.gpu_list:
            self.servers[gpu] = Child(gpu, "server", self.args.log_dir / f"gpu{gpu}-server.log")
            if not self.args.no_workers:
                self.workers[gpu] = Child(gpu, "worker", self.args.log_dir / f"gpu{gpu}-worker.log")

    # -- output ---------------------------------------------------------------------------------

    def event(self, child: Child | None, message: str) -> None:
        who = f"gpu{child.gpu} {child.kind}" if child else "launcher"
        line = f"{datetime.now().isoformat(timespec='seconds')} [{who}] {message}"
        print(line, flush=True)
        self._events.write(line + "\n")
        self.write_status()

    def write_status(self) -> None:
        def describe(c: Child) -> dict:
            return {"pid": c.pid if c.alive() else None, "state": c.state, "starts": c.starts,
                    "restarts": max(0, c.starts - 1), "log": str(c.log_path)}

        status = {"launcher_pid": os.getpid(), "updated": time.time(), "simulate": self.args.simulate,
                  "node": self.args.node,
                  "gpus": {str(g): {"port": self.args.base_port + g, "url": server_url(self.args, g),
                                    "server": describe(s),
                                    "worker": describe(self.workers[g]) if g in self.workers else None}
                           for g, s in self.servers.items()}}
        path = Path(self.args.status_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(status, indent=1))
        os.replace(tmp, path)

    # -- processes ------------------------------------------------------------------------------

    def start(self, c: Child) -> None:
        cmd = server_command(self.args, c.gpu) if c.kind == "server" else worker_command(self.args, c.gpu)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if c.kind == "server":
            env["CUDA_VISIBLE_DEVICES"] = str(c.gpu)
        with open(c.log_path, "ab") as log:
            log.write(f"\n=== {datetime.now().isoformat(timespec='seconds')} launch_node: "
                      f"{shlex.join(cmd)}\n".encode())
            log.flush()
            c.popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
        c.starts += 1
        c.started_at = time.monotonic()
        c.health_fails = 0
        c.next_probe = c.started_at + STARTUP_PROBE_S
        c.state = "starting" if c.kind == "server" else "running"
        extra = f" port={self.args.base_port + c.gpu}" if c.kind == "server" else ""
        self.event(c, f"started pid={c.pid}{extra} (start #{c.starts}) log={c.log_path}")

    def kill_group(self, c: Child, sig: int) -> None:
        if c.popen is not None:
            try:
                os.killpg(c.popen.pid, sig)   # its own session: pgid == pid
            except (ProcessLookupError, PermissionError):
                pass

    def schedule_restart(self, c: Child, why: str) -> None:
        """After an exit (or a kill): clear any leftover helpers, then wait out the backoff."""
        self.kill_group(c, signal.SIGKILL)
        if c.popen is not None:
            try:
                c.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        ran = time.monotonic() - c.started_at
        c.failures = 0 if ran >= self.args.stable_seconds else c.failures + 1
        delay = min(self.args.restart_backoff * 2 ** max(0, c.failures - 1), self.args.restart_backoff_max)
        c.state, c.restart_at, c.probe = "backoff", time.monotonic() + delay, None
        self.event(c, f"{why} after {ran:.0f}s; restarting in {delay:.1f}s")

    def stop_all(self, children: list[Child], timeout: float, sig_group: bool) -> None:
        """SIGTERM (the process, or its whole group), wait up to `timeout`, then SIGKILL the groups."""
        running = [c for c in children if c.alive()]
        for c in running:
            self.event(c, f"stopping pid={c.pid} (SIGTERM)")
            if sig_group:
                self.kill_group(c, signal.SIGTERM)
            else:
                c.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(c.alive() for c in running) and time.monotonic() < deadline and self.signals < 2:
            time.sleep(TICK_S)
        for c in children:
            if c.alive():
                self.event(c, f"still running; SIGKILL pid={c.pid}")
            self.kill_group(c, signal.SIGKILL)   # also any helper left behind by a clean exit
            if c.popen is not None:
                rc = c.popen.wait()
                if c in running:
                    self.event(c, f"stopped rc={rc}")
            c.state = "stopped"

    # -- health ---------------------------------------------------------------------------------

    def _probe(self, gpu: int) -> tuple[bool, str]:
        try:
            r = httpx.get(server_url(self.args, gpu) + "/health", timeout=self.args.health_timeout)
            return r.status_code == 200, f"HTTP {r.status_code}"
        except httpx.HTTPError as exc:
            return False, type(exc).__name__

    def check_server(self, s: Child, now: float) -> None:
        if s.probe is None:
            if now >= s.next_probe:
                s.probe = self._probes.submit(self._probe, s.gpu)
            return
        if not s.probe.done():
            return
        ok, what = s.probe.result()
        s.probe = None
        s.last_probe = what
        if ok:
            was, fails = s.state, s.health_fails
            s.state, s.health_fails, s.healthy_once = "healthy", 0, True
            s.next_probe = now + self.args.health_interval
            if was == "starting":
                self.event(s, f"healthy after {now - s.started_at:.1f}s")
            elif fails:
                self.event(s, f"healthy again after {fails} failed probe(s)")
            return
        if s.state == "starting":
            if now - s.started_at > self.args.startup_timeout:
                self.schedule_restart(s, f"not healthy {self.args.startup_timeout:.0f}s after start ({what})")
            else:
                s.next_probe = now + STARTUP_PROBE_S
            return
        # A running server: 503 while busy is normal, so only a run of failures counts.
        s.health_fails += 1
        if s.health_fails == 1:
            self.event(s, f"health probe failed ({what}); {self.args.unhealthy_after} in a row declare it dead")
        if s.health_fails >= self.args.unhealthy_after:
            self.schedule_restart(s, f"declared dead: {s.health_fails} consecutive failed health probes ({what})")
        else:
            s.next_probe = now + self.args.health_interval

    # -- main loop ------------------------------------------------------------------------------

    def step(self) -> None:
        now = time.monotonic()
        for gpu, s in self.servers.items():
            if s.state == "backoff":
                if now >= s.restart_at:
                    self.start(s)
            elif not s.alive():
                self.schedule_restart(s, f"exited rc={s.popen.returncode}")
            else:
                self.check_server(s, now)
            w = self.workers.get(gpu)
            if w is None:
                continue
            if w.state == "idle":
                if s.healthy_once:   # the first start waits for the server; later ones do not
                    self.start(w)
            elif w.state == "backoff":
                if now >= w.restart_at:
                    self.start(w)
            elif not w.alive():
                self.schedule_restart(w, f"exited rc={w.popen.returncode}")

    def run(self) -> int:
        busy = [g for g in self.args.gpu_list if not port_free(self.args.host, self.args.base_port + g)]
        if busy:
            self.event(None, "port(s) already in use: " + ", ".join(
                str(self.args.base_port + g) for g in busy) + " (another launcher or server?); exiting")
            return 2
        self.event(None, f"pid={os.getpid()} node={self.args.node} gpus={self.args.gpu_list} "
                         f"{'simulated servers' if self.args.simulate else 'model=' + self.args.model_path} "
                         f"base_port={self.args.base_port} workers={'no' if self.args.no_workers else 'yes'}")
        self.event(None, "this launcher starts no beat: run `manage.py beat` once per deployment "
                         "(it seals batches, writes progress.json and marks jobs done)")
        if self.args.simulate and speculative_args(self.args):
            self.event(None, "--simulate: the --speculative-* options are ignored")
        try:
            for s in self.servers.values():
                self.start(s)
            while not self.signals:
                self.step()
                time.sleep(TICK_S)
            self.event(None, "shutting down: workers first, then servers")
        except BaseException as exc:  # a bug or a failed start must not leave servers behind
            self.event(None, f"error: {exc!r}; stopping everything")
            self.signals = max(self.signals, 1)
            self.shutdown()
            raise
        self.shutdown()
        return 0

    def shutdown(self) -> None:
        self.stop_all(list(self.workers.values()), self.args.worker_stop_timeout, sig_group=False)
        self.stop_all(list(self.servers.values()), self.args.server_stop_timeout, sig_group=True)
        self._probes.shutdown(wait=False, cancel_futures=True)
        self.event(None, "all stopped")

    def on_signal(self, signum, _frame) -> None:
        self.signals += 1
        if self.signals > 1:
            print(f"{datetime.now().isoformat(timespec='seconds')} [launcher] second signal "
                  f"({signal.Signals(signum).name}): killing what is left", flush=True)


def port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            return True
        except OSError:
            return False


def main(argv: list[str] | None = None) -> int:
    launcher = Launcher(parse_args(argv))
    signal.signal(signal.SIGTERM, launcher.on_signal)
    signal.signal(signal.SIGINT, launcher.on_signal)
    return launcher.run()


def run() -> None:
    """The `launch_node.py` console script (pyproject.toml), and workers/launch_node.py."""
    sys.exit(main())
