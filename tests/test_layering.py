"""The layering, read from the code's own imports (every import statement, those inside functions too):
core/ imports neither face (kvpool.backends, kvpool.streams), which it reaches by module path only
(`kvpool.core.registry`); nothing in the package imports test scaffolding; the command and suite
registries resolve, with one hook signature, and a face that cannot be imported breaks only itself."""
from __future__ import annotations

import argparse
import ast
import importlib.util
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.core import bench, cli
from kvpool.core.registry import load

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"core": "kvpool.core", "backends": "kvpool.backends", "streams": "kvpool.streams"}
FACES = ("kvpool.backends", "kvpool.streams")


def _modules(folder: str) -> Iterator[tuple[Path, str]]:
    """(file, the package its relative imports resolve against) of every module under `folder`."""
    for path in sorted((ROOT / folder).rglob("*.py")):
        parts = [PACKAGES[folder], *path.relative_to(ROOT / folder).parent.parts]
        yield path, ".".join(parts)


def _imports(path: Path, package: str) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in `path`, at any depth; `from m import a` yields
    both `m` and `m.a` (a may be a submodule)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_core_imports_no_face() -> None:
    found = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path, package in _modules("core") for line, module in _imports(path, package)
             if any(_within(module, face) for face in FACES)]
    assert not found, "core must reach the faces by module path only (kvpool.core.registry):\n" + "\n".join(found)


def _test_helpers() -> set[str]:
    """Names under which test scaffolding is importable: `tests`, and the helper modules beside the
    tests (pytest puts each test's folder on sys.path)."""
    names = {"tests"}
    for folder in {path.parent for path in (ROOT / "tests").rglob("test_*.py")}:
        names.update(path.stem for path in folder.glob("*.py")
                     if not path.name.startswith("test_") and path.name != "conftest.py")
    return names


def test_package_imports_no_test_scaffolding() -> None:
    helpers = _test_helpers()
    assert "sglang_cpu" in helpers
    found = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for folder in PACKAGES for path, package in _modules(folder) for line, module in _imports(path, package)
             if module.split(".")[0] in helpers]
    assert not found, "the installed package must not import test scaffolding:\n" + "\n".join(found)
    assert importlib.util.find_spec("kvpool.backends.sglang_cpu") is None


def test_faces_take_core_only_from_its_public_api() -> None:
    """What a face needs from core is exported by `kvpool.core` (or `kvpool.core.bench` for the bench
    suites); a face never names a module of core, so core's modules may change under it."""
    public = {"kvpool.core", "kvpool.core.bench"}
    found = []
    for folder in ("backends", "streams"):
        for path, _ in _modules(folder):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {m}" for m in names
                          if _within(m, "kvpool.core") and m not in public]
    assert not found, "\n".join(found)
    exported = set(importlib.import_module("kvpool.core").__all__)
    assert {"PoolClient", "ClientConfig", "KVPoolError", "readable", "checksum"} <= exported


def _subparsers() -> argparse._SubParsersAction[argparse.ArgumentParser]:
    return argparse.ArgumentParser(prog="kvpool").add_subparsers(dest="command", required=True)


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_command_hooks_share_one_signature(name: str) -> None:
    hook = load(f"{cli.COMMANDS[name]}:add_parser")
    signature = inspect.signature(hook)  # annotations are strings here (`from __future__ import annotations`)
    params = list(signature.parameters.values())
    assert len(params) == 1 and params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert params[0].annotation == "Subparsers" and signature.return_annotation == "argparse.ArgumentParser"
    sub = _subparsers()
    parser = hook(sub)
    assert isinstance(parser, argparse.ArgumentParser)
    assert list(sub.choices) == [name], "a hook adds the command its COMMANDS key names"


@pytest.mark.parametrize("name", sorted(bench.SUITES))
def test_suites_resolve(name: str) -> None:
    suite = load(bench.SUITES[name])
    assert callable(suite.add_arguments) and callable(suite.run)
    assert (suite.__doc__ or "").strip(), "its first docstring line is the suite's --help line"


def test_faces_suites_live_with_their_faces() -> None:
    assert bench.SUITES["streams"].startswith("kvpool.streams.")
    assert bench.SUITES["backends"].startswith("kvpool.backends.")


def test_a_face_that_cannot_be_imported_breaks_only_itself(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(cli.COMMANDS, "ghost", "kvpool_no_such_face.cli")
    monkeypatch.setitem(bench.SUITES, "ghost", "kvpool_no_such_face.bench_suite")
    parser = cli.build_parser()
    assert "unavailable" in parser.format_help() and "kvpool_no_such_face" in parser.format_help()
    for argv, command in ((["ghost", "--any", "-h", "args"], "kvpool ghost"),
                          (["bench", "ghost", "--quick"], "kvpool bench ghost")):
        args = parser.parse_args(argv)
        assert args.func(args) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"{command}: unavailable: kvpool_no_such_face") and "No module named" in err
    args = parser.parse_args(["mooncake-shim"])  # the others still work
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip().endswith("mooncake_shim")


def test_every_core_module_says_what_it_exports() -> None:
    """Each module of core declares `__all__`: what is not in it is internal to core."""
    missing = [str(path.relative_to(ROOT)) for path, _ in _modules("core")
               if path.name != "__init__.py" or path.parent.name != "tiers"
               if not any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in n.targets)
                          for n in ast.parse(path.read_text()).body)]
    assert not missing, missing
