"""The real-server checks (tests/sglang_checks.py) against the real SGLang 0.5.23 on CPU with a
tiny model: `make test-sglang` installs its environment (tools/sglang_cpu/install.sh), then runs
this file with DFLASH_SGLANG_VENV set. Under plain `make test` every test here is skipped.

One server for the module (it takes 30-70 s to start and about 2 GB); each test gets its own
Redis database, worker and beat, pointed at it."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
import sglang_checks as checks
from support import ROOT, Proc, free_port, wait_until

VENV = os.environ.get("DFLASH_SGLANG_VENV")
TOOLS = ROOT / "tools" / "sglang_cpu"
MODEL_NAME = "tiny-qwen2"
pytestmark = pytest.mark.skipif(not VENV, reason="the real SGLang server: run `make test-sglang`")


def launch_args(python: str, model: Path, port: int) -> list[str]:
    return [python, "-m", "sglang.launch_server", "--model-path", str(model),
            "--served-model-name", MODEL_NAME, "--device", "cpu", "--host", "127.0.0.1",
            "--port", str(port), "--attention-backend", "torch_native", "--disable-cuda-graph",
            "--skip-server-warmup", "--max-total-tokens", "32768", "--dtype", "float32",
            "--enable-metrics", "--reasoning-parser", "qwen3",
            "--context-length", str(checks.CONTEXT_LENGTH)]


def tiny_model(python: str, variant: str = "plain") -> Path:
    """Built once per version of the builder and variant, cached beside the environment."""
    builder = TOOLS / "tiny_model.py"
    digest = hashlib.sha256(builder.read_bytes()).hexdigest()[:12]
    name = "tiny-qwen2" if variant == "plain" else f"tiny-qwen2-{variant}"
    out = Path(VENV) / "models" / f"{name}-{digest}"
    if not (out / "script.json").exists():
        result = subprocess.run([python, str(builder), str(out), "--variant", variant],
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"building the tiny model failed:\n{result.stderr[-3000:]}"
    return out


def script_of(model: Path) -> dict:
    """What the builder recorded: the script's ids, its text, the chat endpoint's answer."""
    return json.loads((model / "script.json").read_text())


class _Shared:
    """Stands in the cluster's server table for the module's server: a cluster's stop() leaves
    it running for the next test."""

    def stop(self) -> None:
        pass

    def alive(self) -> bool:
        return True


def serve(model: Path, log: Path):
    """A real server for `model`, up: (port, Served, Proc)."""
    python = str(Path(VENV) / "bin" / "python")
    port = free_port()
    proc = Proc(launch_args(python, model, port), log, env={"SGLANG_USE_CPU_ENGINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: not proc.alive() or httpx.get(url + "/health", timeout=5).status_code == 200,
                   timeout=300, interval=1, what="the real SGLang server to start")
        assert proc.alive(), f"the SGLang server exited:\n{proc.log()[-4000:]}"
    except BaseException:
        print(proc.log()[-4000:])
        proc.stop()
        raise
    return port, checks.Served(url, MODEL_NAME, "real"), proc


@pytest.fixture(scope="module")
def real_model():
    return tiny_model(str(Path(VENV) / "bin" / "python"))


@pytest.fixture(scope="module")
def real_server(real_model, tmp_path_factory):
    port, served, proc = serve(real_model, tmp_path_factory.mktemp("sglang") / "sglang-server.log")
    yield port, served
    proc.stop(timeout=30)


@pytest.fixture
def penalty_server(tmp_path):
    """The penalty variant (generation_config.json sets repetition_penalty and min_p), for one
    test: started and stopped there (the module's server runs beside it meanwhile)."""
    model = tiny_model(str(Path(VENV) / "bin" / "python"), "penalty")
    port, served, proc = serve(model, tmp_path / "sglang-server.log")
    yield served, script_of(model)
    proc.stop(timeout=30)


@pytest.fixture
def served_cluster(cluster, real_server):
    port, served = real_server
    c = cluster(server_metrics_interval_s=0.5)
    c.servers[0] = (port, _Shared())
    c.start_worker(0)
    c.start_beat()
    return c, served


def test_http_surface(real_server):
    checks.check_http_surface(real_server[1])


def test_job_end_to_end(served_cluster, tmp_path):
    checks.check_job_end_to_end(*served_cluster, tmp_path)


def test_context_errors_are_permanent(served_cluster, tmp_path):
    checks.check_context_errors(*served_cluster, tmp_path)


def test_regenerate_continue(served_cluster, tmp_path):
    checks.check_regenerate_continue(*served_cluster, tmp_path)


def test_abort_and_continue(real_server):
    checks.check_abort_and_continue(real_server[1])


def test_cut_at_every_offset(real_server, real_model):
    checks.check_cut_at_every_offset(real_server[1], script_of(real_model))


def test_sampling_defaults_and_penalised_cut(penalty_server):
    checks.check_sampling_defaults(*penalty_server)
