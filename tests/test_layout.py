"""The layout's rules, checked: stages import only downwards (import-linter's contract in
.importlinter), every Redis key string stays in keys.py and every Lua script in its stage's
`lua/`, loaded by name through core/scripts.py, only the settings read
DFLASH_* variables, only the entry points reach for the process's Settings, Redis and Ledger, and
docs/ARCHITECTURE.md's key table names exactly the keys keys.py makes."""
from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT

from dflash_tasks.core import keys

PACKAGES = ("dflash_tasks", "dflash_dev")
KEYS_OWNER = "dflash_tasks/core/keys.py"
SCRIPTS_OWNER = "dflash_tasks/core/scripts.py"
SETTINGS_OWNER = "dflash_tasks/core/settings.py"


def modules(*packages: str) -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(ROOT)), ast.parse(p.read_text()))
            for package in packages for p in sorted((ROOT / package).rglob("*.py"))]


def strings(tree: ast.AST):
    """Every string constant but docstrings (prose may name a key or a script), f-strings'
    literal parts included, with its line."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def test_stages_import_only_downwards_and_never_the_dev_tools():
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--config", str(ROOT / ".importlinter")], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in done.stdout, done.stdout[-2000:]


def test_redis_key_strings_live_only_in_keys_py():
    stray = [f"{path}:{line}: {value!r}" for path, tree in modules(*PACKAGES) if path != KEYS_OWNER
             for line, value in strings(tree) if re.search(r"(^|[^\w])dflash:", value)]
    assert not stray, "Redis key strings outside core/keys.py:\n" + "\n".join(stray)


def test_lua_scripts_live_with_their_stage_and_are_loaded_only_by_the_script_loader():
    """Each stage keeps its scripts in its own `lua/` folder; only core/scripts.py reads them
    and talks Lua to Redis, and a stage names a script by its name, never by its file."""
    stray = []
    for path, tree in modules(*PACKAGES):
        if path == SCRIPTS_OWNER:
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("register_script", "eval", "evalsha", "script_load")
                    and node.args):
                stray.append(f"{path}:{node.lineno}: .{node.func.attr}(...)")
        # A file name, or an f-string's ".lua" part (prose that names a script has spaces).
        stray += [f"{path}:{line}: {value!r}" for line, value in strings(tree)
                  if value.endswith(".lua") and not re.search(r"\s", value)]
    assert not stray, "Lua outside the script loader:\n" + "\n".join(stray)
    lua = sorted(p.relative_to(ROOT) for p in (ROOT / "dflash_tasks").rglob("*.lua"))
    assert lua and all(p.parent.name == "lua" for p in lua), lua


def test_no_script_indexes_keys_or_arguments_by_hand():
    """The loader binds KEYS and ARGV to the names each script declares: a key added in the
    middle shifts nothing."""
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
             for p in sorted((ROOT / "dflash_tasks").rglob("*.lua"))
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\b(KEYS|ARGV)\b", line) and not line.lstrip().startswith("--")]
    assert not found, "KEYS/ARGV indexed by hand:\n" + "\n".join(found)


def test_every_script_loads_and_each_call_names_exactly_its_keys_and_arguments():
    from dflash_tasks.core.scripts import Script, ScriptError

    scripts = {}
    for module in ("dflash_tasks.core.jobs", "dflash_tasks.ledger", "dflash_tasks.dispatch.window",
                   "dflash_tasks.output.sealing", "dflash_tasks.output.progress",
                   "dflash_tasks.worker.heartbeat", "dflash_tasks.training.queue.runs"):
        for value in vars(importlib.import_module(module)).values():
            if isinstance(value, Script):
                scripts[value.path] = value
    # The files that other scripts prepend (`--- uses:`) are not scripts of their own.
    on_disk = {p for p in (ROOT / "dflash_tasks").rglob("*.lua")
               if p.stem not in ("elsewhere", "shares", "going_on")}
    assert set(scripts) == on_disk, sorted(str(p) for p in on_disk ^ set(scripts))
    take = scripts[ROOT / "dflash_tasks" / "dispatch" / "lua" / "take.lua"]
    with pytest.raises(ScriptError, match="missing .*window.*unknown windw"):
        take(None, **{n: "" for n in (*take.keys, *take.args) if n != "window"}, windw=3)


def test_only_the_settings_read_dflash_variables():
    def is_environ(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    reads = []
    for path, tree in modules("dflash_tasks"):
        if path == SETTINGS_OWNER:
            continue
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute) and (
                    (node.func.attr == "get" and is_environ(node.func.value)) or node.func.attr == "getenv"):
                name = node.args[0]
            elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
                name = node.slice
            if isinstance(name, ast.Constant) and str(name.value).startswith("DFLASH_"):
                reads.append(f"{path}:{node.lineno}: {name.value}")
    assert not reads, "DFLASH_* read outside Settings:\n" + "\n".join(reads)


MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "deque", "Counter", "OrderedDict", "Lock",
                 "RLock", "Event", "local", "Condition", "Semaphore"}
STATE_ALLOWED = ("dflash_tasks/core/", "dflash_tasks/worker/runtime.py")


def test_no_mutable_module_state_outside_core_and_the_worker_runtime():
    """A module-level container is a constant table (an UPPER_CASE or dunder name, never
    changed); nothing rebinds a module global."""
    found = []
    for path, tree in modules("dflash_tasks"):
        found += [f"{path}:{n.lineno}: global {', '.join(n.names)}" for n in ast.walk(tree)
                  if isinstance(n, ast.Global)]
        if path.startswith(STATE_ALLOWED):
            continue
        for node in tree.body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp,
                                         ast.SetComp)) or (
                isinstance(value, ast.Call) and (getattr(value.func, "id", None) in MUTABLE_CALLS
                                                 or getattr(value.func, "attr", None) in MUTABLE_CALLS))
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            found += [f"{path}:{node.lineno}: {name}" for name in names if mutable
                      and not (name.lstrip("_").isupper() or name.startswith("__"))]
    assert not found, "mutable module-level state:\n" + "\n".join(found)


# The process's accessors: only the entry points reach for them, and pass what they get down.
ACCESSORS = {"get_settings", "redis_client", "shared_ledger", "runtime"}
ENTRY_POINTS = ("dflash_tasks/tasks/", "dflash_tasks/cli/", "dflash_tasks/worker/hooks.py",
                "dflash_tasks/worker/runtime.py",
                # a library for training scripts: no source given means the deployment's storage
                "dflash_tasks/training/torch_dataset.py")
DEFINED_IN = ("dflash_tasks/core/settings.py", "dflash_tasks/core/connections.py",
              "dflash_tasks/ledger/__init__.py")


def test_only_the_entry_points_reach_for_the_process_accessors():
    calls = []
    for path, tree in modules("dflash_tasks"):
        if path.startswith(ENTRY_POINTS) or path in DEFINED_IN:
            continue
        calls += [f"{path}:{node.lineno}: {node.func.id}()" for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ACCESSORS]
    assert not calls, ("called below the entry points (take it as an argument instead):\n"
                       + "\n".join(calls))


# Where a job's or a GPU's name comes in, and so may be made into its value (and checked):
NAMES_COME_IN = {
    "dflash_tasks/cli/": "a command's options",
    "dflash_tasks/tasks/": "a task's arguments",
    "dflash_tasks/worker/hooks.py": "the queues a worker consumes",
    "dflash_tasks/core/jobs.py": "the names of the jobs, as Redis has them",
    "dflash_tasks/dispatch/__init__.py": "the GPU registry and a job's GPUs, as Redis has them",
    "dflash_tasks/output/stats.py": "the GPUs of a job's counters and rows",
    "dflash_tasks/training/queue/": "a training run's record in Redis",
}
MAKERS = {"JobName", "GpuName", "check_job_name"}


def test_a_job_or_gpu_name_is_made_into_its_value_only_where_it_comes_in():
    """Below those places a JobName or GpuName is passed as it is: no stage re-checks or
    re-parses it (issue 31)."""
    made = []
    for path, tree in modules("dflash_tasks"):
        if path == KEYS_OWNER or path.startswith(tuple(NAMES_COME_IN)):
            continue
        for node in ast.walk(tree):
            func = getattr(node, "func", None)
            name = getattr(func, "id", None) or getattr(getattr(func, "value", None), "id", None)
            if isinstance(node, ast.Call) and name in MAKERS:
                made.append(f"{path}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not made, "a name made into its value below where it comes in:\n" + "\n".join(made)


# -- docs/ARCHITECTURE.md's key table --------------------------------------------------------------

PLACEHOLDERS = {"job": "<job>", "run": "<run>", "gpu": "<gpu>", "part": "*", "reason": "<reason>"}
# Validators, GPU names and Celery's queue names: not keys of the project's own.
NOT_KEYS = {"check_job_name", "check_node_name"}


def _call(fn, drop_self: bool = False) -> str:
    params = list(inspect.signature(fn).parameters)[1 if drop_self else 0:]
    missing = [p for p in params if p not in PLACEHOLDERS]
    assert not missing, f"{fn.__qualname__}: add a placeholder for {missing} to PLACEHOLDERS"
    return fn(*[PLACEHOLDERS[p] for p in params])


def keys_in_code() -> set[str]:
    found = {v for v in vars(keys).values() if isinstance(v, str) and v.startswith("dflash:")}
    for name, fn in inspect.getmembers(keys, inspect.isfunction):
        if fn.__module__ == keys.__name__ and not name.startswith("_") and name not in NOT_KEYS:
            value = _call(fn)
            if value.startswith("dflash:"):
                found.add(value)
    job = keys.JobName("job")  # its keys read dflash:{job}:…, as the table writes them
    for name, attr in vars(keys.JobName).items():
        if name.startswith("_") or name == "every_key":  # every_key: a SCAN pattern, not a key
            continue
        if isinstance(attr, property):
            found.add(getattr(job, name))
        elif inspect.isfunction(attr):
            found.add(_call(getattr(job, name)))
    return found


def keys_in_docs() -> set[str]:
    table = [line for line in (ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines()
             if line.startswith("| `dflash:")]
    return {key for line in table for key in re.findall(r"`([^`]+)`", line.split("|")[1])}


def test_the_architecture_key_table_matches_keys_py():
    code, docs = keys_in_code(), keys_in_docs()
    assert code == docs, (f"only in keys.py: {sorted(code - docs)}; "
                          f"only in docs/ARCHITECTURE.md: {sorted(docs - code)}")


def test_importing_the_celery_config_reads_no_setting():
    """celeryconfig's names are what does not depend on the deployment; the rest comes from the
    process's Settings through deployment(s), when the app is made (tasks/app.py)."""
    bad = {"PATH": "/usr/bin:/bin", "DFLASH_REDIS_URL": "nonsense://"}  # refused by Settings
    done = subprocess.run([sys.executable, "-c", "import celeryconfig"], cwd=ROOT, env=bad,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
