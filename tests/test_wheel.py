"""The package as a wheel, without the checkout: every console entry point and every stage (the
Lua scripts are package data) work from a fresh virtual environment, in a scratch directory.

The wheel is installed without its dependencies; the fresh environment sees this suite's
installed ones through a path file (no network, and the same versions), but not the editable
install of the checkout: `.pth` files are processed only in site directories, and the line added
here is a plain path, so the checkout's editable finder never runs there."""
from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

from support import ROOT

STAGES = ("ledger", "dispatch.window", "output.sealing", "worker.heartbeat",
          "training.queue.runs", "tasks.generate", "cli.launch_node")


def run(args: list, cwd: Path, **kw) -> str:
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin"}, **kw)
    assert done.returncode == 0, f"{args}: {done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_installed_wheel_runs_without_the_checkout(tmp_path):
    # Built from a copy of the files git would commit (a fresh clone's tree): a build writes
    # build/ and the egg-info beside the sources, which must not land in the checkout.
    source = tmp_path / "source"
    tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True,
                             check=True).stdout.decode().split("\0")
    for name in filter(None, tracked):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    wheels = tmp_path / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", wheels, source], cwd=tmp_path)
    wheel = next(wheels.glob("dflash_tasks-*.whl"))
    env_dir = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
         "-q", wheel], cwd=tmp_path)
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=tmp_path).strip())
    (site / "suite_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    where = run([python, "-c", "import dflash_tasks, celeryconfig; "
                 "print(dflash_tasks.__file__); print(celeryconfig.__file__)"], cwd=scratch)
    assert all(line.startswith(str(env_dir)) for line in where.split()), where
    imports = "; ".join(f"import dflash_tasks.{stage}" for stage in STAGES)
    run([python, "-c", imports], cwd=scratch)  # each stage loads its Lua scripts
    assert "Commands:" in run([env_dir / "bin" / "manage.py", "--help"], cwd=scratch)
    assert "--gpus LIST" in run([env_dir / "bin" / "launch_node.py", "--help"], cwd=scratch)
    # the node launcher's children: manage.py's commands by module, the simulated server too
    assert "--slots" in run([python, "-m", "dflash_tasks.cli", "sim-server", "--help"], cwd=scratch)
