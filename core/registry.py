"""Parts of kvpool that core reaches by module path only, the way vLLM's `KVConnectorFactory` loads a
connector from a name: the command line (`cli.COMMANDS`), the bench (`bench.SUITES`) and kvtest's
notifications (`bench.notify`) name the faces' modules (`kvpool.streams...`, `kvpool.backends...`) as
strings and import them when they are used. So core never imports a face, and a face whose optional
dependencies are missing breaks only its own commands: they say what is missing when run.

A command module's hook is `add_parser(subparsers) -> argparse.ArgumentParser` (`AddParser`): it adds
its subcommand, sets `func` (`args -> exit status`) as the parser default, and returns the parser.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import sys
from typing import Any, Protocol, TypeAlias

from .errors import ConfigError

__all__ = ["AddParser", "Subparsers", "add_command", "add_unavailable", "load"]

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""What `ArgumentParser.add_subparsers()` returns (argparse names no public type for it)."""


class AddParser(Protocol):
    """A command module's `add_parser` hook: adds its subcommand to `subparsers`, with `func` set."""

    def __call__(self, subparsers: Subparsers, /) -> argparse.ArgumentParser: ...


def load(path: str) -> Any:
    """`"package.module"` -> that module; `"package.module:attr"` -> that attribute of it, imported
    now. A module that cannot be imported (an optional dependency missing) is a `ConfigError` that
    names what is missing."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:  # its message names what is missing
        raise ConfigError(f"{module_name} cannot be imported: {e}") from e
    if not attr:
        return module
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise ConfigError(f"{module_name} has no {attr!r}: {path!r} names nothing") from e


def add_unavailable(subparsers: Subparsers, name: str, reason: str, prog: str) -> argparse.ArgumentParser:
    """A stand-in for subcommand `name` whose module cannot be imported: listed in `--help`, it takes
    any arguments (`-h` included) and, when run, prints `reason` and exits with status 2."""
    p = subparsers.add_parser(name, help=f"(unavailable: {reason})", add_help=False,
                              prefix_chars="\0")  # no option is parsed: every argument lands in `args`
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=functools.partial(_unavailable, f"{prog} {name}", reason))
    return p


def _unavailable(command: str, reason: str, args: argparse.Namespace) -> int:
    print(f"{command}: unavailable: {reason}", file=sys.stderr)
    return 2


def add_command(subparsers: Subparsers, name: str, module: str, prog: str = "kvpool") -> argparse.ArgumentParser:
    """Subcommand `name` from `module`'s `add_parser` hook, or its stand-in (`add_unavailable`) when
    `module` cannot be imported."""
    try:
        hook: AddParser = load(f"{module}:add_parser")
    except ConfigError as e:
        return add_unavailable(subparsers, name, str(e), prog)
    return hook(subparsers)
