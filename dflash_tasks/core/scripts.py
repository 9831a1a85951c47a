"""Lua scripts by name: each stage keeps the scripts that decide its things in its own `lua/`
folder, and calls them through a `Script`, with its keys and arguments named.

A script file declares, in its first lines,

    --- keys: config pending inflight
    --- args: window job gpu ...ids
    --- uses: elsewhere

`keys` and `args` name KEYS and ARGV in order (`...name`, last of args: the remaining arguments
as a table); `uses` prepends the functions of other files of the same folder. The loader writes
the `local config, pending, inflight = KEYS[1], KEYS[2], KEYS[3]` the body would otherwise
index by hand, so no script says KEYS[n] or ARGV[n], and a key added in the middle shifts
nothing. A call names every key and argument (`script(r, config=..., window=3, ...)`): a missing
or an extra name is refused before anything reaches Redis.
"""
from __future__ import annotations

import re
from pathlib import Path

from redis.commands.core import Script as _RedisScript

_DECLARATION = re.compile(r"^--- (keys|args|uses):(.*)$")
_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")


class ScriptError(ValueError):
    """A script file whose declaration is wrong, or a call that does not match it."""


class Script:
    def __init__(self, module_file: str, name: str):
        """The script `name` of the stage whose module is `module_file` (its `__file__`):
        `lua/<name>.lua` beside it."""
        folder = Path(module_file).parent / "lua"
        self.name = name
        self.path = folder / f"{name}.lua"
        declared, body = _declaration(self.path)
        self.keys, self.args = declared["keys"], declared["args"]
        self.rest = self.args[-1][3:] if self.args and self.args[-1].startswith("...") else None
        if self.rest is not None:
            self.args = self.args[:-1]
        names = [*self.keys, *self.args, *([self.rest] if self.rest else [])]
        bad = [n for n in names if not _NAME.match(n)]
        if bad or len(set(names)) != len(names):
            raise ScriptError(f"{self.path}: names must be distinct Lua identifiers: {names}")
        uses = "".join(_declaration(folder / f"{other}.lua")[1] for other in declared["uses"])
        self._lua = _RedisScript(None, (self._preamble() + uses + body).encode())

    def _preamble(self) -> str:
        lines = []
        for table, names in (("KEYS", self.keys), ("ARGV", self.args)):
            if names:
                lines.append(f"local {', '.join(names)} = "
                             + ", ".join(f"{table}[{i}]" for i in range(1, len(names) + 1)))
        if self.rest:
            lines.append(f"local {self.rest} = {{}}\n"
                         f"for i = {len(self.args) + 1}, #ARGV do "
                         f"{self.rest}[#{self.rest} + 1] = ARGV[i] end")
        return "\n".join(lines) + "\n"

    def __call__(self, client, **named):
        """Run it on `client` (a Redis client or a pipeline) with every key and argument by
        name; the rest argument, if declared, is a sequence."""
        expected = {*self.keys, *self.args, *([self.rest] if self.rest else [])}
        missing, extra = expected - named.keys(), named.keys() - expected
        if missing or extra:
            raise ScriptError(f"{self.name}.lua: "
                              + "; ".join(part for part in (
                                  f"missing {', '.join(sorted(missing))}" if missing else "",
                                  f"unknown {', '.join(sorted(extra))}" if extra else "") if part))
        args = [named[a] for a in self.args] + (list(named[self.rest]) if self.rest else [])
        return self._lua(keys=[named[k] for k in self.keys], args=args, client=client)


def _declaration(path: Path) -> tuple[dict[str, list[str]], str]:
    """A file's declared names and its text (the declaration lines stay, as comments)."""
    text = path.read_text()
    declared: dict[str, list[str]] = {"keys": [], "args": [], "uses": []}
    for line in text.splitlines():
        match = _DECLARATION.match(line)
        if match:
            declared[match.group(1)] += match.group(2).split()
    return declared, text
