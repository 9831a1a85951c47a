"""The deployment files: docker-compose.yml checked statically (no Docker engine here) against the
real CLI, and workers/launch_node.py run for real against simulated servers."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
from pathlib import Path

import click
import httpx
import pytest
import yaml
from support import ROOT, Proc, free_port, python, wait_until

from dflash_dev.local import free_port_run
from dflash_tasks.cli import cli

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict] = COMPOSE["services"]


# -- helpers ------------------------------------------------------------------------------------

# What the deployment is started with; ${REDIS_PASSWORD:?...} is required (compose refuses to
# start without it), every other variable has its default.
PASSWORD = "s3cret-compose-test"
COMPOSE_ENV = {"REDIS_PASSWORD": PASSWORD}


def interpolate(text: str, env: dict[str, str] = COMPOSE_ENV) -> str:
    """Compose's ${VAR:-default} / ${VAR} / ${VAR:?error} with `env`: its values, else the
    defaults; a required variable missing from `env` raises, as compose refuses to start."""
    def value(m: re.Match) -> str:
        name, kind, rest = m.group(1), m.group(2), m.group(3) or ""
        if env.get(name):
            return env[name]
        if kind == ":?":
            raise KeyError(f"{name} is required: {rest}")
        return rest
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}", value, text)


def argv(service: dict) -> list[str]:
    command = service.get("command") or []
    if isinstance(command, str):
        return shlex.split(interpolate(command))
    return [interpolate(str(a)) for a in command]


def manage_call(service: dict) -> tuple[str, list[str]] | None:
    """(subcommand, its arguments) when the service runs `python manage.py X ...`."""
    args = argv(service)
    for i, token in enumerate(args):
        if Path(token).name == "manage.py":
            assert i + 1 < len(args), f"{args}: manage.py without a subcommand"
            return args[i + 1], args[i + 2:]
    return None


def cli_errors(subcommand: str, args: list[str]) -> list[str]:
    """What is wrong with `manage.py SUBCOMMAND ARGS`, judged by the click group itself."""
    ctx = click.Context(cli, info_name="manage.py")
    command = cli.get_command(ctx, subcommand)
    if command is None:
        return [f"no subcommand {subcommand!r} (have: {', '.join(cli.list_commands(ctx))})"]
    known = set(ctx.help_option_names)
    for param in command.params:
        known.update(param.opts)
        known.update(param.secondary_opts)
    errors = [f"{subcommand}: unknown option {token.split('=', 1)[0]!r}"
              for token in args if token.startswith("-") and token.split("=", 1)[0] not in known]
    if not errors:
        try:  # values, types, ranges, required options; parsing only, the command does not run
            command.make_context(subcommand, list(args), parent=ctx)
        except click.ClickException as exc:
            errors.append(f"{subcommand} {shlex.join(args)}: {exc.format_message()}")
    return errors


def options(args: list[str]) -> dict[str, str | None]:
    """--flag value / --flag=value / --switch, as a dict."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        token = args[i]
        if token.startswith("--"):
            if "=" in token:
                key, value = token.split("=", 1)
                out[key] = value
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                out[token] = args[i + 1]
                i += 1
            else:
                out[token] = None
        i += 1
    return out


def gpu_devices(service: dict) -> list[str]:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    ids = []
    for device in devices:
        assert "gpu" in device.get("capabilities", []), device
        ids.extend(str(d) for d in device.get("device_ids", []))
    return ids


def load_launcher():
    from dflash_tasks.cli import launch_node

    return launch_node


SGLANG = {name: s for name, s in SERVICES.items() if "sglang.launch_server" in argv(s)}
WORKERS = {name: s for name, s in SERVICES.items()
           if (m := manage_call(s)) and m[0] == "worker" and "--gpu" in m[1]}


# -- docker-compose.yml -------------------------------------------------------------------------

def test_cli_check_catches_typos():
    assert cli_errors("worker", ["--gpu", "0", "--sglang-url", "http://x:1"]) == []
    assert cli_errors("wroker", ["--gpu", "0"])
    assert cli_errors("worker", ["--gpuu", "0"])
    assert cli_errors("worker", ["--gpu", "-1"])           # out of range
    assert cli_errors("worker", ["--sglang-url", "http://x:1"])  # --gpu is required
    assert cli_errors("flower", ["--adress", "0.0.0.0"])
    assert cli_errors("worker", ["--queue", "train"]) == []
    assert cli_errors("worker", ["--queue", "train", "--gpu", "0"])   # one role
    assert cli_errors("worker", ["--queue", "train", "--concurrency", "2"])


def test_manage_py_services_use_real_subcommands_and_options():
    calls = {name: call for name, s in SERVICES.items() if (call := manage_call(s))}
    assert {"flower", "beat", "worker"} <= {sub for sub, _ in calls.values()}, calls
    assert calls["train-worker"] == ("worker", ["--queue", "train"])
    errors = [f"service {name}: {e}" for name, (sub, args) in calls.items() for e in cli_errors(sub, args)]
    assert not errors, "\n".join(errors)


def test_project_services_build_from_the_dockerfile():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", dockerfile, re.M)
    assert "pip install -r requirements.txt" in dockerfile
    assert re.search(r"^WORKDIR /app$", dockerfile, re.M)
    for name, service in SERVICES.items():
        if not manage_call(service):
            continue
        assert service.get("build") in (".", {"context": "."}), name
        env = service["environment"]
        assert interpolate(env["DFLASH_REDIS_URL"]) == f"redis://:{PASSWORD}@redis:6379/0", name
        assert env["DFLASH_OUTPUT_DIR"] == "/data/output", name
        assert "DFLASH_S3_URI" in env and "AWS_ACCESS_KEY_ID" in env and "AWS_SECRET_ACCESS_KEY" in env
        mounts = [v.split(":")[:2] for v in service.get("volumes", []) if isinstance(v, str)]
        assert any(target == "/data/output" and source in COMPOSE["volumes"] for source, target in mounts), name
    flower = SERVICES["flower"]
    assert "DFLASH_FLOWER_BASIC_AUTH" in flower["environment"]
    # Reachable from outside its container (Docker's port mapping), published on loopback only:
    # Flower speaks plain HTTP (docs/SECURITY.md puts it behind TLS).
    assert options(manage_call(flower)[1]).get("--address") == "0.0.0.0"
    assert [str(p) for p in flower["ports"]] == ["127.0.0.1:5555:5555"]


def test_redis_is_persistent_and_never_evicts():
    redis_service = SERVICES["redis"]
    assert redis_service["image"].split(":")[0] == "redis" and redis_service["image"].startswith("redis:7")
    opts = options(argv(redis_service))
    assert opts.get("--appendonly") == "yes"
    assert opts.get("--appendfsync") == "everysec"
    assert opts.get("--maxmemory-policy") == "noeviction"
    # A bound, so that beat's memory hold (DFLASH_REDIS_MEMORY_HOLD_RATIO of it) stops dispatch
    # before Redis refuses writes.
    assert opts.get("--maxmemory") == "16gb"
    assert any(str(v).split(":")[0] in COMPOSE["volumes"] and str(v).split(":")[1] == "/data"
               for v in redis_service["volumes"])


def test_redis_without_the_password_refuses_the_deployments_connections(tmp_path):
    """redis-server started with the compose service's own flags: a client without the password
    is refused (NOAUTH), one with the URL the services get is served. Compose refuses to start
    without REDIS_PASSWORD, and every service's URL carries it."""
    import redis

    service = SERVICES["redis"]
    with pytest.raises(KeyError, match="REDIS_PASSWORD is required"):
        interpolate(" ".join(service["command"]), env={})
    urls = {name: interpolate(s["environment"]["DFLASH_REDIS_URL"])
            for name, s in SERVICES.items() if "DFLASH_REDIS_URL" in s.get("environment", {})}
    assert {"flower", "beat", "worker-gpu0", "train-worker"} <= set(urls), urls
    assert all(f":{PASSWORD}@redis:" in url for url in urls.values()), urls
    assert interpolate(service["environment"]["REDISCLI_AUTH"]) == PASSWORD  # the healthcheck's
    assert "PONG" in " ".join(service["healthcheck"]["test"])  # NOAUTH exits 0 too

    port = free_port()
    server = Proc([*argv(service), "--port", str(port), "--bind", "127.0.0.1", "--dir",
                   str(tmp_path)], tmp_path / "redis.log")  # where compose maps 6379 and /data
    try:
        url = urls["worker-gpu0"].replace("@redis:6379", f"@127.0.0.1:{port}")
        wait_until(lambda: redis.Redis.from_url(url).ping(), timeout=20, what="redis-server")
        with pytest.raises(redis.AuthenticationError):  # redis-py's RESP3 HELLO, refused
            redis.Redis(port=port).set("k", "v")
        with pytest.raises(redis.AuthenticationError, match="Authentication required"):  # NOAUTH
            redis.Redis(port=port, protocol=2).set("k", "v")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url.replace(PASSWORD, "wrong")).ping()
        served = redis.Redis.from_url(url)
        assert served.set("k", "v") and served.get("k") == b"v"
        assert served.config_get("appendonly") == {"appendonly": "yes"}
        assert int(served.config_get("maxmemory")["maxmemory"]) == 16 * 1024 ** 3
        assert PASSWORD not in server.log()
    finally:
        server.stop()


def test_each_server_reserves_one_distinct_gpu_with_the_launchers_flags():
    assert len(SGLANG) >= 2, "two GPUs shown"
    launcher = load_launcher()
    expected = options(launcher.server_command(
        launcher.parse_args(["--gpus", "0", "--model-path", "M"]), 0)[3:])
    seen: set[str] = set()
    for name, service in SGLANG.items():
        assert interpolate(service["image"]).startswith("lmsysorg/sglang:"), name
        devices = gpu_devices(service)
        assert len(devices) == 1, f"{name} reserves {devices}"
        assert devices[0] not in seen, f"GPU {devices[0]} reserved twice"
        seen.add(devices[0])
        assert name == f"sglang-gpu{devices[0]}", f"{name} holds GPU {devices[0]}"
        opts = options(argv(service)[argv(service).index("sglang.launch_server") + 1:])
        assert set(opts) == set(expected), f"{name}: {set(opts) ^ set(expected)}"
        for flag in ("--reasoning-parser", "--max-running-requests", "--mem-fraction-static",
                     "--enable-metrics"):
            assert opts[flag] == expected[flag], f"{name} {flag}: {opts[flag]} != {expected[flag]}"
        assert "/health" in " ".join(map(str, service["healthcheck"]["test"])), name
        assert str(opts["--port"]) in " ".join(map(str, service["healthcheck"]["test"])), name


def test_each_worker_points_at_its_own_gpus_server():
    ports = {name: options(argv(s))["--port"] for name, s in SGLANG.items()}
    served = set()
    for name, service in WORKERS.items():
        opts = options(manage_call(service)[1])
        url = httpx.URL(opts["--sglang-url"])
        assert url.host in SGLANG, f"{name} calls {url.host}, not an sglang service"
        assert str(url.port) == ports[url.host], f"{name} calls port {url.port}, server on {ports[url.host]}"
        assert gpu_devices(SGLANG[url.host]) == [opts["--gpu"]], \
            f"{name} --gpu {opts['--gpu']} but {url.host} holds {gpu_devices(SGLANG[url.host])}"
        assert service["depends_on"][url.host]["condition"] == "service_healthy", name
        assert url.host not in served, f"two workers on {url.host}"
        served.add(url.host)
    assert served == set(SGLANG), f"servers without a worker: {set(SGLANG) - served}"


# -- workers/launch_node.py, for real -----------------------------------------------------------

def port_pair() -> int:
    """A port P with P and P+1 both free (the launcher binds them itself)."""
    return free_port_run(2)


def healthy(port: int) -> bool:
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200


def group_gone(pid: int) -> bool:
    """No process is left in the child's process group (it runs in its own session)."""
    try:
        os.killpg(pid, 0)
        return False
    except ProcessLookupError:
        return True


class Node:
    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None):
        self.logs = tmp / "logs"
        self.status_file = self.logs / "launch_node.json"
        self.proc = Proc(python("workers/launch_node.py", "--log-dir", str(self.logs),
                                "--restart-backoff", "0.2", "--health-interval", "0.5", *args),
                         tmp / "launcher.log", env=env)
        self.pids: set[int] = set()

    def status(self) -> dict:
        status = json.loads(self.status_file.read_text())
        for gpu in status["gpus"].values():
            for kind in ("server", "worker"):
                if gpu[kind] and gpu[kind]["pid"]:
                    self.pids.add(gpu[kind]["pid"])
        return status

    def child(self, gpu: int, kind: str) -> dict:
        return self.status()["gpus"][str(gpu)][kind]

    def stop(self) -> None:
        """Kill the launcher and, should it have left any, its children's groups."""
        self.proc.kill() if self.proc.alive() else None
        for pid in self.pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def node(tmp_path):
    nodes: list[Node] = []

    def make(*args: str, env: dict[str, str] | None = None) -> Node:
        n = Node(tmp_path, *args, env=env)
        nodes.append(n)
        return n

    yield make
    for n in nodes:
        n.stop()


def test_launcher_restarts_a_dead_server_and_stops_everything_on_sigterm(node):
    base = port_pair()
    n = node("--gpus", "0,1", "--simulate", "--no-workers", "--base-port", str(base))
    for port in (base, base + 1):
        wait_until(lambda: healthy(port), timeout=60, what=f"simulated server on {port}")
    wait_until(lambda: all(n.child(g, "server")["state"] == "healthy" for g in (0, 1)),
               timeout=30, what="both servers healthy in the status file")
    first, other = n.child(0, "server")["pid"], n.child(1, "server")["pid"]
    assert f"[gpu0 server] started pid={first} port={base}" in n.proc.log()
    assert "CUDA_VISIBLE_DEVICES" not in n.proc.log()  # set in the environment, not the command line

    os.kill(first, signal.SIGKILL)  # as SGLang's watchdog would
    restarted = wait_until(
        lambda: (c := n.child(0, "server"))["pid"] not in (None, first) and c["state"] == "healthy" and c,
        timeout=60, what="gpu0's server restarted and healthy")
    assert restarted["restarts"] == 1
    assert healthy(base)
    assert n.child(1, "server")["pid"] == other and n.child(1, "server")["restarts"] == 0
    assert "[gpu0 server] exited rc=-9" in n.proc.log()

    n.proc.popen.send_signal(signal.SIGTERM)
    assert n.proc.popen.wait(timeout=60) == 0, n.proc.log()
    assert {first, other, restarted["pid"]} <= n.pids
    for pid in n.pids:
        wait_until(lambda: group_gone(pid), timeout=10, what=f"process group {pid} gone")
    for port in (base, base + 1):
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    assert "all stopped" in n.proc.log()


def test_launcher_runs_workers_restarts_them_and_stops_them_before_servers(node, redis_url, tmp_path):
    import redis

    base = port_pair()
    r = redis.Redis.from_url(redis_url)
    n = node("--node", "n1", "--gpus", "0", "--simulate", "--base-port", str(base),
             "--max-running-requests", "8",
             env={"DFLASH_REDIS_URL": redis_url, "DFLASH_OUTPUT_DIR": str(tmp_path / "output")})
    wait_until(lambda: n.child(0, "worker")["pid"], timeout=60, what="gpu0's worker started")
    first = n.child(0, "worker")["pid"]
    # The worker starts only once its server answered /health.
    log = n.proc.log()
    assert log.index("[gpu0 server] healthy") < log.index("[gpu0 worker] started")
    assert f"--sglang-url http://127.0.0.1:{base}" in (n.logs / "gpu0-worker.log").read_text()
    assert "--gpu 0 --node n1" in (n.logs / "gpu0-worker.log").read_text()
    wait_until(lambda: r.hexists("dflash:workers", "gpu0@n1"), timeout=60, what="worker registered")

    os.kill(first, signal.SIGKILL)
    wait_until(lambda: (c := n.child(0, "worker"))["pid"] not in (None, first) and c["restarts"] == 1,
               timeout=60, what="gpu0's worker restarted")

    n.proc.popen.send_signal(signal.SIGTERM)
    assert n.proc.popen.wait(timeout=120) == 0, n.proc.log()
    log = n.proc.log()
    assert log.index("[gpu0 worker] stopped") < log.index("[gpu0 server] stopping"), log
    for pid in n.pids:
        wait_until(lambda: group_gone(pid), timeout=10, what=f"process group {pid} gone")


# -- the dependencies: ranges in pyproject.toml, the lock in requirements.txt ---------------------

def test_the_lock_satisfies_every_range_and_every_range_has_a_lower_bound():
    """pyproject.toml's ranges are what an install falls back to when the index lacks a locked
    version (make install); the lock is what the tests ran with. Each must hold the other."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    wanted += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra
               if not r.startswith(project["name"])]
    lock = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            lock[canonicalize_name(name)] = version
    for req in wanted:
        assert any(spec.operator == ">=" for spec in req.specifier), f"{req}: no lower bound"
        version = lock.get(canonicalize_name(req.name))
        assert version is not None, f"{req.name} is not in the lock (requirements.txt)"
        assert req.specifier.contains(version, prereleases=True), \
            f"the lock's {req.name}=={version} is outside {req}"
