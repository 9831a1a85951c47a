"""`make local` and `make local-stop`: a deployment of one's own on this machine that stays up
between commands, for running one's own jobs on simulated GPUs.

`start` runs, each in a session of its own so they outlive this command: a redis-server of its
own on a free port, with the deployed persistence (appendonly, fsync every second; its data kept
in DIR/.redis across stops), a simulated node of N GPUs (workers/launch_node.py --simulate: a
server and a pinned worker per GPU, supervised), beat, and Flower with a password of its own
(DIR/.flower-password, readable by this user only). Batches go to DIR (DFLASH_OUTPUT_DIR). It
prints the one `export` line a shell needs and the next commands. `stop` stops them in the
reverse order (the node's workers with a warm stop, then its servers), Redis last.

DIR is output/local unless LOCAL_DIR says otherwise (make reads it from the environment too).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import time
from pathlib import Path

import click
import httpx
import redis

from dflash_dev.local import Proc, free_port, free_port_run, python, wait_until
from dflash_tasks.core.keys import WORKERS, GpuName

ROOT = Path(__file__).resolve().parent.parent
NODE = "local"
# The simulated servers: fast enough that a job of a few hundred prompts takes a minute or two.
SIM_ARGS = "--decode-tps 1000"
ORDER = ("redis", "node", "beat", "flower")  # started in this order, stopped in the reverse


def _state_path(where: Path) -> Path:
    return where / ".state.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _running(where: Path) -> dict | None:
    """The state of a deployment started in `where` whose Redis still runs, else None."""
    try:
        state = json.loads(_state_path(where).read_text())
    except (OSError, ValueError):
        return None
    return state if _alive(state["pids"].get("redis", 0)) else None


def _say_how_to_use(state: dict) -> None:
    venv_bin = Path(state["python"]).parent
    dataset = ROOT / "examples" / "prompts.jsonl"
    click.echo(f"""
Running on this machine (logs in {state["logs"]}):
  Redis   {state["redis_url"]}  (its own; appendonly, data kept in {state["redis_dir"]})
  GPUs    {", ".join(state["gpus"])}: simulated SGLang servers with their workers
  beat    seals and ships batches into {state["output"]}
  Flower  {state["flower_url"]}  (user local, password in {state["flower_password"]})

In each shell that uses it (every command then works from any directory):

export PATH="{venv_bin}:$PATH" DFLASH_REDIS_URL={state["redis_url"]} DFLASH_OUTPUT_DIR={state["output"]}

Then:
  manage.py enqueue --dataset {dataset} --job mine --limit 50 --follow
  manage.py stats --job mine
  manage.py export --job mine --to mine-export

Stop everything (from any directory; your jobs stay in Redis's data for the next make local):
  make -C {ROOT} local-stop LOCAL_DIR={state["output"]}""")


@click.group()
def cli() -> None:
    """A deployment of one's own on this machine (make local, make local-stop)."""


@cli.command()
@click.option("--dir", "where", type=click.Path(file_okay=False, path_type=Path),
              default=ROOT / "output" / "local", show_default="output/local",
              help="Where its Redis data, logs and batches go.")
@click.option("--gpus", type=click.IntRange(1, 16), default=2, show_default=True,
              help="Simulated GPUs.")
def start(where: Path, gpus: int) -> None:
    """Start Redis, a simulated node, beat and Flower, and leave them running."""
    where = where.expanduser().resolve()
    if (state := _running(where)) is not None:
        click.echo(f"Already running (started {time.ctime(state['started'])}); "
                   "make local-stop stops it.")
        _say_how_to_use(state)
        return
    if not shutil.which("redis-server"):
        raise click.ClickException("redis-server is not on the PATH (Debian: apt-get install "
                                   "redis-server)")
    logs, redis_dir = where / ".logs", where / ".redis"
    for folder in (logs, redis_dir):
        folder.mkdir(parents=True, exist_ok=True)
    redis_port, flower_port, base_port = free_port(), free_port(), free_port_run(gpus)
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    password_file = where / ".flower-password"
    if not password_file.exists():
        password_file.touch(mode=0o600)
        password_file.write_text(secrets.token_urlsafe(16) + "\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DFLASH_REDIS_URL": redis_url,
           "DFLASH_OUTPUT_DIR": str(where),
           "DFLASH_FLOWER_BASIC_AUTH": f"local:{password_file.read_text().strip()}"}
    procs: dict[str, Proc] = {}
    try:
        procs["redis"] = Proc(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                               "--dir", str(redis_dir), "--save", "", "--appendonly", "yes",
                               "--appendfsync", "everysec"], logs / "redis.log", env=env)
        r = redis.Redis.from_url(redis_url)
        wait_until(r.ping, timeout=30, what="redis-server")
        procs["node"] = Proc(python(str(ROOT / "workers" / "launch_node.py"), "--simulate",
                                    "--node", NODE, "--gpus", ",".join(map(str, range(gpus))),
                                    "--base-port", str(base_port), "--sim-args", SIM_ARGS,
                                    "--log-dir", str(logs)), logs / "launch_node.out", env=env)
        names = [GpuName.on(NODE, i) for i in range(gpus)]
        wait_until(lambda: all(r.hexists(WORKERS, g) for g in names), timeout=120,
                   what=f"the workers of {', '.join(names)} to register (logs in {logs})")
        procs["beat"] = Proc(python("manage.py", "beat"), logs / "beat.log", env=env)
        wait_until(lambda: "ready." in procs["beat"].log(), timeout=60,
                   what=f"beat to start ({logs / 'beat.log'})")
        procs["flower"] = Proc(python("manage.py", "flower", "--port", str(flower_port)),
                               logs / "flower.log", env=env)
        flower_url = f"http://127.0.0.1:{flower_port}"
        wait_until(lambda: httpx.get(flower_url).status_code == 401, timeout=60,
                   what=f"Flower to answer ({logs / 'flower.log'})")
    except BaseException:
        for name in reversed(ORDER):
            if name in procs:
                procs[name].stop()
        raise
    state = {"started": time.time(), "python": str(Path(python()[0])), "redis_url": redis_url,
             "redis_dir": str(redis_dir), "logs": str(logs), "output": str(where),
             "gpus": names, "flower_url": flower_url, "flower_password": str(password_file),
             "pids": {name: proc.pid for name, proc in procs.items()}}
    _state_path(where).write_text(json.dumps(state, indent=1))
    _say_how_to_use(state)


@cli.command()
@click.option("--dir", "where", type=click.Path(file_okay=False, path_type=Path),
              default=ROOT / "output" / "local", show_default="output/local",
              help="The deployment's directory, as given to start.")
def stop(where: Path) -> None:
    """Stop what start started, Redis last; its data, logs and batches stay."""
    where = where.expanduser().resolve()
    try:
        state = json.loads(_state_path(where).read_text())
    except (OSError, ValueError):
        click.echo(f"Nothing started in {where}.")
        return
    for name in reversed(ORDER):
        pid = state["pids"].get(name)
        if pid is None or not _alive(pid):
            continue
        try:
            os.killpg(pid, signal.SIGTERM)  # each runs in a session (a group) of its own
        except ProcessLookupError:
            continue
        # the node's warm stop lets generations in flight finish (its workers' grace)
        deadline = time.monotonic() + (360 if name == "node" else 60)
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)
        click.echo(f"stopped {name} (pid {pid})")
    _state_path(where).unlink(missing_ok=True)
    click.echo(f"Stopped. Data, logs and batches stay in {where}.")


if __name__ == "__main__":
    cli()
