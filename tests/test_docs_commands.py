"""Every shell command example of the docs, run as pasted against a live deployment, from a fresh
copy of the repository's root and from another directory. The examples are read from the
Markdown (README.md, docs/*.md, workers/README.md) by these rules, which the docs follow:

- Every fenced code block says what it is. `bash` (or `sh`, `shell`): every line is a command
  (`\\` at the end continues it; blank and `#` comment lines are skipped). `console`: the lines
  starting with `$ ` are commands, the others their output (shown, not compared). Any other
  tag (`text`, `json`, `toml`, `python`) is not run. A block with no tag fails this test.
- `<!-- not run: REASON -->` on a line before a block: the block is not run (docker compose, a
  GPU node, a long-running process, a usage synopsis with placeholders). `<!-- not run `PREFIX`:
  REASON -->`: the block's commands that start with PREFIX are not run, the others are.
  A marker without a reason fails this test.
- `<!-- file: NAME -->` before a block: the block is an example file the following commands use
  (train.toml); it is written to NAME in the directory the commands run in, before any runs.

A command fails the test if it exits non-zero or prints a Python traceback. The shell is a user's
after the documented set-up: `.venv/bin` first on PATH (as `source .venv/bin/activate` does), the
deployment's DFLASH_* settings in the environment (Redis, output directory). The deployment is the
test suite's own (tests/conftest.py's Cluster: real Redis, two simulated servers, their workers
and beat). Every job a command names with `--job` exists before the commands run, done, from the
bundled examples/prompts.jsonl, unless a documented `enqueue` creates it.

"The repository root" is a copy of the tracked files in a temporary directory (a fresh clone's
tree), so that what the commands write stays out of the working tree. From the other directory,
a path the commands give relative to the repository (examples/prompts.jsonl) is given as that
file's absolute path, as a user there would type it.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import Cluster
from support import ROOT
from test_pipeline import start

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "workers" / "README.md"]
SHELL_TAGS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*(not run|file)\b(.*?)-->\s*$")
SIM_ARGS = ("--slots", "40", "--decode-tps", "8000")


@dataclass
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    tag: str
    body: list[str]
    markers: list[tuple[str, str]] = field(default_factory=list)  # (kind, rest)

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


@dataclass
class Command:
    where: str
    text: str


def blocks(doc: Path) -> list[Block]:
    lines = doc.read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, tag, start = m.group(1), m.group(2), i
        markers, j = [], i - 1
        while j >= 0 and (not lines[j].strip() or MARKER.match(lines[j])):
            if mm := MARKER.match(lines[j]):
                markers.insert(0, (mm.group(1), mm.group(2).strip()))
            j -= 1
        i += 1
        body = []
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        out.append(Block(doc, start + 1, tag, body, markers))
        i += 1
    return out


def commands_of(block: Block) -> list[str]:
    commands, cur = [], None  # cur: a command continued by a trailing backslash
    for line in block.body:
        if cur is not None:
            text = cur + " " + line.strip()
        elif block.tag == "console":
            if not line.startswith("$ "):
                continue  # output
            text = line[2:].strip()
        elif not line.strip() or line.lstrip().startswith("#"):
            continue
        else:
            text = line.strip()
        if text.endswith("\\"):
            cur = text[:-1].rstrip()
        else:
            commands.append(text)
            cur = None
    return commands


def not_run_prefix(rest: str) -> tuple[str | None, str]:
    """`: reason` (the whole block) or `` `PREFIX`: reason ``."""
    m = re.match(r"^(?:`([^`]+)`)?\s*:\s*(.*)$", rest)
    if not m:
        raise AssertionError(f"malformed marker 'not run{rest}'")
    return m.group(1), m.group(2).strip()


def collect() -> tuple[list[Command], dict[str, str], list[str]]:
    """The commands to run, the example files, and the rule violations found."""
    commands, files, problems = [], {}, []
    for doc in DOCS:
        for block in blocks(doc):
            if not block.tag:
                problems.append(f"{block.where}: a code block without a tag (bash, console, text...)")
                continue
            skip_all, prefixes = False, []
            for kind, rest in block.markers:
                if kind == "file":
                    name = rest.lstrip(":").strip()
                    if not name:
                        problems.append(f"{block.where}: a file marker without a name")
                    files[name] = "\n".join(block.body) + "\n"
                    continue
                try:
                    prefix, reason = not_run_prefix(rest)
                except AssertionError as exc:
                    problems.append(f"{block.where}: {exc}")
                    continue
                if not reason:
                    problems.append(f"{block.where}: a 'not run' marker gives no reason")
                if prefix is None:
                    skip_all = True
                else:
                    prefixes.append(prefix)
            if block.tag not in SHELL_TAGS or skip_all:
                continue
            cmds = commands_of(block)
            for prefix in prefixes:
                if not any(c.startswith(prefix) for c in cmds):
                    problems.append(f"{block.where}: 'not run `{prefix}`' matches no command")
            commands += [Command(block.where, c) for c in cmds
                         if not any(c.startswith(p) for p in prefixes)]
    return commands, files, problems


def test_the_docs_follow_the_rules_and_have_commands_to_run():
    commands, files, problems = collect()
    assert not problems, "\n".join(problems)
    texts = [c.text for c in commands]
    # The extraction itself: commands from each kind of block, continuations joined.
    assert any(t.startswith("manage.py enqueue --dataset examples/prompts.jsonl") for t in texts)
    assert any("&& manage.py export" in t for t in texts), texts
    assert "train.toml" in files
    assert len(commands) >= 20, texts


def test_the_rules_catch_an_untagged_block_and_a_marker_without_reason(tmp_path, monkeypatch):
    doc = tmp_path / "DOC.md"
    doc.write_text("```\nmanage.py jobs\n```\n\n<!-- not run: -->\n```bash\nmanage.py jobs\n```\n"
                   "<!-- not run `manage.py worker`: long-running -->\n```console\n"
                   "$ manage.py worker --gpu 0\n$ manage.py jobs \\\n  --json\nout\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "DOCS", [doc])
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    commands, _, problems = collect()
    assert [c.text for c in commands] == ["manage.py jobs --json"]
    assert problems == ["DOC.md:1: a code block without a tag (bash, console, text...)",
                        "DOC.md:6: a 'not run' marker gives no reason"]


# --- running them ---------------------------------------------------------------------------

def deploy(c: Cluster) -> tuple[list[Command], dict[str, str], dict[str, str]]:
    """Servers, workers and beat; every job the commands name and no `enqueue` of theirs creates,
    done; the commands, the example files and the environment of a user's shell."""
    start(c, sim_args=SIM_ARGS)
    commands, files, problems = collect()
    assert not problems, "\n".join(problems)
    enqueued = {m.group(1) for cmd in commands
                if (m := re.search(r"\benqueue\b.*--job (\S+)", cmd.text))}
    named = {job for cmd in commands for job in re.findall(r"--job (\S+)", cmd.text)}
    for job in sorted(named - enqueued):
        c.manage("enqueue", "--dataset", str(ROOT / "examples" / "prompts.jsonl"), "--job", job,
                 "--limit", "20")
    for job in sorted(named - enqueued):
        c.wait_done(job, timeout=120)
    venv_bin = Path(sys.executable).parent
    env = {**os.environ, **c.env, "VIRTUAL_ENV": str(venv_bin.parent),
           "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("PYTHONPATH", None)
    return commands, files, env


def run_all(commands, files, env, cwd: Path, root: Path) -> list[str]:
    for name, text in files.items():
        (cwd / name).parent.mkdir(parents=True, exist_ok=True)
        (cwd / name).write_text(text)
    failures = []
    for cmd in commands:
        text = cmd.text
        if cwd != root:
            words = shlex.split(text, comments=True)
            for word in words:
                if "/" in word and not word.startswith(("/", "-", "s3:", "http")) \
                        and (root / word).exists() and not (cwd / word).exists():
                    text = text.replace(word, str(root / word))
        result = subprocess.run(["bash", "-o", "pipefail", "-c", text], cwd=cwd, env=env,
                                capture_output=True, text=True, timeout=180)
        output = result.stdout + result.stderr
        if result.returncode != 0 or "Traceback (most recent call last)" in output:
            failures.append(f"{cmd.where} (in {cwd}): `{text}` exited {result.returncode}:\n"
                            f"{output[-2500:]}")
    return failures


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The tracked files of the repository, as a fresh clone has them."""
    dest = tmp_path_factory.mktemp("clone")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode().split("\0")
    for name in filter(None, tracked):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def test_every_docs_command_runs_from_the_repository_root(cluster, clone):
    commands, files, env = deploy(cluster())
    failures = run_all(commands, files, env, clone, clone)
    assert not failures, f"{len(failures)} of {len(commands)} commands failed:\n\n" + \
        "\n\n".join(failures)


def test_every_docs_command_runs_from_another_directory(cluster, clone, tmp_path):
    """On a deployment of its own: the docs' story starts from jobs that do not exist yet."""
    commands, files, env = deploy(cluster())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    failures = run_all(commands, files, env, elsewhere, clone)
    assert not failures, f"{len(failures)} of {len(commands)} commands failed:\n\n" + \
        "\n\n".join(failures)
