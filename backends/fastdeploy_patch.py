"""Registers `kvpool` as a `--kvcache-storage-backend` of an installed FastDeploy, reversibly.

FastDeploy has no plugin hook for KV-cache storage: the backend names are argparse `choices` and a
hard-coded if/elif in its cache transfer manager. `enable()` edits two files of the installed package:
it adds "kvpool" to both parsers' choices and to the manager's data-path dispatch tuples, and adds
the branch that constructs `kvpool.backends.fastdeploy.KVPoolStore`. Every added line ends with
`# kvpool`; every replaced line is kept above its replacement as `# kvpool-was: <original line>`, so
`disable()` restores the files byte for byte. Both are idempotent; `status()` changes nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvpool.core import KVPoolError, Subparsers

MARK = "  # kvpool"
"""Ends every line enable() adds."""
WAS = "# kvpool-was: "
"""Starts (at column 0) every original line enable() replaced."""

ARGS_FILE = "engine/args_utils.py"
MANAGER_FILE = "cache_manager/cache_transfer_manager.py"


class PatchError(KVPoolError):
    """FastDeploy cannot be found, or its source does not have the lines the patch expects."""


@dataclasses.dataclass
class _Edit:
    line: int
    """0-based index in the unpatched file."""
    new: list[str]
    """Lines (without marker or newline) that replace the line, or are inserted before it."""
    replace: bool
    what: str


@dataclasses.dataclass
class FileReport:
    path: str
    state: str
    """"enabled", "disabled", "outdated" (patched by another kvpool version: run enable again)."""
    changes: list[str]


@dataclasses.dataclass
class Report:
    """What enable / disable / status found and did, per file."""

    package: str
    action: str
    files: list[FileReport]
    changed: bool

    @property
    def state(self) -> str:
        states = {f.state for f in self.files}
        return states.pop() if len(states) == 1 else "partial"

    def __str__(self) -> str:
        head = {"enable": "enabled" if self.changed else "already enabled",
                "disable": "disabled" if self.changed else "already disabled",
                "status": self.state}[self.action]
        out = [f"kvpool storage backend for FastDeploy at {self.package}: {head}"]
        for f in self.files:
            out.append(f"  {f.path}: {f.state}")
            out += [f"    {c}" for c in f.changes]
        return "\n".join(out)


# ----- where the lines go ------------------------------------------------------------------------

_CHOICES = re.compile(r'^(?P<head>\s*choices\s*=\s*\[)(?P<items>[^\]]*"mooncake"[^\]]*?)(?P<tail>,?\s*\]\s*,?\s*)$')
_DISPATCH = re.compile(r'(storage_backend_type\s+(?:not\s+)?in\s+)(?P<open>[(\[])'
                       r'(?P<items>[^)\]]*"mooncake"[^)\]]*?)(?P<close>,?\s*[)\]])')
_UNSUPPORTED = re.compile(r'^\s*raise NotImplementedError\(f?"Unsupported storage backend')


def _choices_edit(lines: list[str], flag: str) -> list[_Edit]:
    """Add "kvpool" to the `choices=[...]` of the add_argument call that defines `flag`."""
    at = next((i for i, ln in enumerate(lines) if f'"{flag}"' in ln), None)
    if at is None:
        raise PatchError(f"no {flag} argument found: this FastDeploy has no KV-cache storage backends")
    for i in range(at, min(at + 12, len(lines))):
        m = _CHOICES.match(lines[i])
        if m:
            if '"kvpool"' in m["items"]:
                return []
            new = f'{m["head"]}{m["items"]}, "kvpool"{m["tail"]}'
            return [_Edit(i, [new], True, f'{flag}: choices += "kvpool"')]
        if lines[i].strip() == ")":
            break
    raise PatchError(f"the {flag} argument at line {at + 1} has no one-line choices=[...] naming mooncake")


def _branch_edit(lines: list[str]) -> list[_Edit]:
    """Insert `elif ... == "kvpool":` before the `else:` that raises for unsupported backends."""
    r = next((i for i, ln in enumerate(lines) if _UNSUPPORTED.match(ln)), None)
    e = r - 1 if r is not None else -1
    while e >= 0 and not lines[e].strip():
        e -= 1
    if r is None or lines[e].strip() != "else:":
        raise PatchError("no `else: raise NotImplementedError(\"Unsupported storage backend ...\")` found "
                         "in the cache transfer manager")
    ind = lines[e][:len(lines[e]) - len(lines[e].lstrip())]
    body = lines[r][:len(lines[r]) - len(lines[r].lstrip())]
    branch = [
        f'{ind}elif args.kvcache_storage_backend == "kvpool":',
        f"{body}from kvpool.backends.fastdeploy import KVPoolStore",
        f'{body}logger.info("Start initialize kvpool store...")',
        f'{body}self.storage_backend = KVPoolStore(namespace=args.model_path or getattr(self, "model_id", None), '
        f'tp_rank=self.rank, tp_size=getattr(self, "n_ranks", 1), cache_dtype=getattr(self, "cache_dtype", None))',
        f"{body}self._init_storage_buffer(args)",
        f'{body}logger.info("Initialized kvpool store successfully")',
    ]
    return [_Edit(e, branch, False, "storage backend factory: branch constructing KVPoolStore")]


def _dispatch_edits(lines: list[str]) -> list[_Edit]:
    """Add "kvpool" wherever the manager tests `storage_backend_type in ("mooncake", ...)` (the read,
    query and write-back data paths) or `not in ["mooncake"]` (the block_wise_fp8 check)."""
    edits = []
    data_paths = 0
    for i, ln in enumerate(lines):
        m = _DISPATCH.search(ln)
        if m and '"kvpool"' not in m["items"]:
            test = " ".join(m.group(1).split())
            data_paths += "not" not in test.split()
            new = ln[:m.start("close")] + ', "kvpool"' + ln[m.start("close"):]
            edits.append(_Edit(i, [new], True, f'{test} {m["open"]}{m["items"]}{m["close"].strip()} += "kvpool"'))
        elif m:
            data_paths += 1
    if not data_paths:
        raise PatchError('no `storage_backend_type in ("mooncake", ...)` data-path dispatch found in the cache '
                         "transfer manager: kvpool would be constructed but never used")
    return edits


_PATCHES: dict[str, Callable[[list[str]], list[_Edit]]] = {
    ARGS_FILE: lambda lines: _choices_edit(lines, "--kvcache-storage-backend"),
    MANAGER_FILE: lambda lines: (_choices_edit(lines, "--kvcache_storage_backend") + _branch_edit(lines)
                                 + _dispatch_edits(lines)),
}
"""The files enable() edits, relative to the package directory, and how."""


# ----- text transforms ---------------------------------------------------------------------------

def _split(text: str) -> list[tuple[str, str]]:
    """(line, line ending) pairs, so that joining them gives `text` back exactly."""
    return [(ln.rstrip("\r\n"), ln[len(ln.rstrip("\r\n")):]) for ln in text.splitlines(keepends=True)]


def unpatched(text: str) -> str:
    """`text` with every kvpool edit undone (unchanged if there is none)."""
    out = []
    for line, end in _split(text):
        if line.endswith(MARK):
            continue
        out.append((line[len(WAS):] if line.startswith(WAS) else line) + end)
    return "".join(out)


def patched(text: str, rel: str) -> tuple[str, list[str]]:
    """(`text` with kvpool's edits for file `rel`, one line per change); `text` must be unpatched."""
    pairs = _split(text)
    lines = [ln for ln, _ in pairs]
    nl = next((end for _, end in pairs if end), "\n")
    edits = {e.line: e for e in _PATCHES[rel](lines)}
    out: list[str] = []
    changes: list[str] = []
    for i, (line, end) in enumerate(pairs):
        e = edits.get(i)
        if e is not None:
            if e.replace:
                out.append(WAS + line + end)
            changes.append(f"line {len(out) + 1}: {e.what}")
            out += [new + MARK + nl for new in e.new]
            if e.replace:
                continue
        out.append(line + end)
    return "".join(out), changes


# ----- the package on disk -----------------------------------------------------------------------

def find_package(path: str | os.PathLike[str] | None = None) -> Path:
    """FastDeploy's package directory: `path` (the package dir, or a dir holding `fastdeploy/`), or
    the one this interpreter imports."""
    if path is not None:
        p = Path(path)
        if not (p / ARGS_FILE).exists() and (p / "fastdeploy" / ARGS_FILE).exists():
            p = p / "fastdeploy"
    else:
        spec = importlib.util.find_spec("fastdeploy")
        if spec is None or not spec.submodule_search_locations:
            raise PatchError(f"FastDeploy is not installed for {sys.executable}; install fastdeploy-gpu in this "
                             "environment or pass --path to its package directory")
        p = Path(list(spec.submodule_search_locations)[0])
    missing = [rel for rel in _PATCHES if not (p / rel).is_file()]
    if missing:
        raise PatchError(f"{p} is not a FastDeploy package with KV-cache storage (missing {', '.join(missing)})")
    return p.resolve()


def _read(path: Path) -> str:
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def _write(path: Path, text: str) -> None:
    """Replace `path` atomically, keeping its permission bits."""
    mode = path.stat().st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".kvpool-tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _survey(pkg: Path) -> list[tuple[str, str, str, str, list[str]]]:
    """Per file: (rel, current text, unpatched text, patched text, changes)."""
    out = []
    for rel in _PATCHES:
        current = _read(pkg / rel)
        base = unpatched(current)
        try:
            target, changes = patched(base, rel)
        except PatchError as e:
            raise PatchError(f"{pkg / rel}: {e}") from None
        out.append((rel, current, base, target, changes))
    return out


def _state(current: str, base: str, target: str) -> str:
    return "enabled" if current == target else "disabled" if current == base else "outdated"


def enable(path: str | os.PathLike[str] | None = None) -> Report:
    """Make `--kvcache-storage-backend kvpool` work in the FastDeploy at `path` (default: the installed
    one). Nothing is written unless every file can be patched; a second call changes nothing."""
    pkg = find_package(path)
    files = []
    changed = False
    for rel, current, _base, target, changes in _survey(pkg):
        if current != target:
            _write(pkg / rel, target)
            changed = True
        files.append(FileReport(rel, "enabled", changes if current != target else []))
    return Report(str(pkg), "enable", files, changed)


def disable(path: str | os.PathLike[str] | None = None) -> Report:
    """Remove every kvpool line from the FastDeploy at `path`, restoring the original files exactly."""
    pkg = find_package(path)
    files = []
    changed = False
    for rel in _PATCHES:
        current = _read(pkg / rel)
        base = unpatched(current)
        if base != current:
            _write(pkg / rel, base)
            changed = True
            n = sum(1 for ln, _ in _split(current) if ln.endswith(MARK) or ln.startswith(WAS))
            files.append(FileReport(rel, "disabled", [f"removed {n} kvpool lines, restored the originals"]))
        else:
            files.append(FileReport(rel, "disabled", []))
    return Report(str(pkg), "disable", files, changed)


def status(path: str | os.PathLike[str] | None = None) -> Report:
    """Whether the FastDeploy at `path` is patched, without changing it; `changes` lists what enable()
    would do (disabled, outdated) or did (enabled)."""
    pkg = find_package(path)
    files = [FileReport(rel, _state(current, base, target), changes)
             for rel, current, base, target, changes in _survey(pkg)]
    return Report(str(pkg), "status", files, False)


# ----- command line ------------------------------------------------------------------------------

def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """`kvpool fastdeploy enable|disable|status [--path DIR]`."""
    p = subparsers.add_parser(
        "fastdeploy", help="register kvpool as FastDeploy's --kvcache-storage-backend (edits FastDeploy; reversible)",
        description="FastDeploy has no plugin hook for KV-cache storage, so `enable` edits the installed "
                    f"package ({ARGS_FILE}, {MANAGER_FILE}); every added line ends with '# kvpool' and "
                    "`disable` restores the original files exactly. Exit status: 0, or 1 on an error "
                    "(and for `status`, when kvpool is not enabled).")
    p.add_argument("action", choices=["enable", "disable", "status"])
    p.add_argument("--path", help="FastDeploy's package directory (default: the one this Python imports)")
    p.set_defaults(func=_cmd)
    return p


def _cmd(args: argparse.Namespace) -> int:
    action = {"enable": enable, "disable": disable, "status": status}[args.action]
    try:
        report = action(args.path)
    except (PatchError, OSError) as e:
        print(f"kvpool fastdeploy {args.action}: {e}", file=sys.stderr)
        return 1
    print(report)
    return 0 if args.action != "status" or report.state == "enabled" else 1
