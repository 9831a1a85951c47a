"""The README's "Your own job on this machine", run as written: `make local`, the export line it
prints pasted into a shell, the three commands from another directory, `make local-stop`.

The one liberty: make reads LOCAL_DIR from the environment, so the deployment lives in the
test's directory instead of the repository's output/local (a user's own would be there)."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import httpx
from support import ROOT

SECTION = "## Your own job on this machine"


def readme_blocks() -> list[list[str]]:
    """The section's bash blocks, each as its command lines."""
    text = (ROOT / "README.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return [[line for line in body.strip().splitlines() if line.strip()]
            for body in re.findall(r"```bash\n(.*?)```", section, re.S)]


def shell(command: str, cwd: Path, env: dict, timeout: float = 300) -> str:
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in output, \
        f"`{command}` exited {result.returncode}:\n{output[-3000:]}"
    return output


def test_the_local_recipe_runs_as_the_readme_writes_it(tmp_path):
    start, use, stop = readme_blocks()
    assert [line.split("#")[0].strip() for line in start + stop] == ["make local", "make local-stop"]
    where = tmp_path / "local"
    # A user's shell: none of the suite's DFLASH_* settings.
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env["LOCAL_DIR"] = str(where)
    try:
        printed = shell(start[0], ROOT, env)
        export = next(line for line in printed.splitlines() if line.startswith("export "))
        state = json.loads((where / ".state.json").read_text())
        assert len(state["gpus"]) == 2 and state["output"] == str(where)
        redis_dir = Path(state["redis_dir"])
        # Started twice, it says it runs already and how to use it.
        again = shell(start[0], ROOT, env)
        assert "Already running" in again and export in again

        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        outputs = []
        for command in use:  # a path into the repository, given as a user there types it
            command = command.replace("examples/prompts.jsonl", str(ROOT / "examples" / "prompts.jsonl"))
            outputs.append(shell(f"{export}\n{command}", elsewhere, env))
        enqueued, stats, exported = outputs
        assert "job mine: done" in enqueued and "50/50" in enqueued, enqueued[-2000:]
        assert "finish reasons:" in stats
        assert re.search(r"rows\s+50 \(one per id\)", exported), exported
        assert (where / "mine" / "manifest.json").exists()      # the job's own location
        assert list((elsewhere / "mine-export").rglob("*.jsonl.zst"))

        password = Path(state["flower_password"]).read_text().strip()
        assert httpx.get(state["flower_url"]).status_code == 401
        assert httpx.get(state["flower_url"], auth=("local", password)).status_code == 200
        assert oct(Path(state["flower_password"]).stat().st_mode & 0o777) == "0o600"
    finally:
        # The stop `make local` printed, pasted from another directory (the README's own
        # `make local-stop` is the same from the repository with its LOCAL_DIR)
        lines = printed.splitlines() if "printed" in locals() else []
        hint = next((lines[i + 1].strip() for i, line in enumerate(lines)
                     if line.startswith("Stop everything") and i + 1 < len(lines)), None)
        if hint is not None:
            assert hint == f"make -C {ROOT} local-stop LOCAL_DIR={where}", hint
            said = shell(hint, tmp_path, {k: v for k, v in env.items() if k != "LOCAL_DIR"})
        else:
            said = shell(stop[0], ROOT, env)
    assert "Stopped." in said
    for name, pid in state["pids"].items():
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z", f"{name} (pid {pid}) still runs"
    assert not (where / ".state.json").exists()
    assert any(redis_dir.rglob("*.aof*")), "Redis kept no append-only file"
