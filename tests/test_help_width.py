"""Every command's --help fits an 80-column terminal (issue 42, item 5): manage.py, each of its
commands and workers/launch_node.py, rendered as they are on such a terminal (COLUMNS=80)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support import ROOT

from dflash_tasks.cli import COMMANDS

WIDTH = 80


def help_text(*argv: str) -> str:
    env = {**os.environ, "COLUMNS": str(WIDTH)}
    result = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("argv", [("manage.py",), *(("manage.py", c) for c in sorted(COMMANDS)),
                                  ("workers/launch_node.py",)],
                         ids=lambda argv: " ".join(argv))
def test_help_fits_80_columns(argv):
    wide = [line for line in help_text(*argv).splitlines() if len(line) > WIDTH]
    assert not wide, "\n".join(f"{len(line)}: {line}" for line in wide)


def test_train_help_names_every_section_of_its_config():
    from dflash_tasks.training.queue.spec import SECTIONS

    text = " ".join(help_text("manage.py", "train").split())
    assert all(f"[{section}]" in text for section in SECTIONS), text
