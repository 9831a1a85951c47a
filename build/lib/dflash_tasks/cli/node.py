"""The `launch_node.py` console script: runs workers/launch_node.py (what runs on a GPU node)
from any directory, as `python workers/launch_node.py` does from the repository's root."""
from __future__ import annotations

import runpy
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "workers" / "launch_node.py"


def main() -> None:
    if not SCRIPT.exists():
        raise SystemExit(f"launch_node.py: {SCRIPT} is missing: this command needs the "
                         "repository checkout it was installed from (pip install -e .)")
    runpy.run_path(str(SCRIPT), run_name="__main__")
