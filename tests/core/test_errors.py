"""The error contract (issue 13): every error a caller can meet is a typed `KVPoolError`, timeouts are
also `TimeoutError`s, errors carry their key, size and limit as attributes, and no failure is
swallowed without a log line. The package's source is scanned for raises of untyped errors and for
broad handlers that drop what they catch."""
from __future__ import annotations

import ast
import builtins
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.core import PoolClient, TieredCache
from kvpool.core.blocks import checksum
from kvpool.core.errors import BlockTooLarge, InvalidArgument, KVPoolError
from kvpool.core.memory_backend import MemoryBackend
from kvpool.streams import CorruptPayload, PayloadError
from kvpool.streams.envelope import Ref
from kvpool.streams.payload import fetch

from corehelp import MiB

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"kvpool.core": "core", "kvpool.backends": "backends", "kvpool.streams": "streams"}

UNTYPED = {"ValueError", "RuntimeError", "KVPoolError"}
"""Raised by name, these escape the contract: ValueError/RuntimeError are not KVPoolErrors, and a bare
KVPoolError says nothing a caller can catch on (pick or add a subclass in core/errors.py)."""

LOG_CALLS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}

ALLOWED: dict[tuple[str, str, str], str] = {}
"""(file, enclosing function, what) -> why it stays: only where an engine's contract demands a specific
exception. `what` is the raised name, or "except" for a broad handler. Empty today: every engine that
expects ValueError gets InvalidArgument/ConfigError, which are ValueErrors."""


# ----- (a) the classes --------------------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    package = next(name for name, folder in PACKAGES.items() if rel.parts[0] == folder)
    return ".".join((package, *rel.parts[1:])).removesuffix(".__init__")


def _exception_classes() -> list[type[BaseException]]:
    """Every public exception class the packages define. Found in the source first (a class whose base is a
    builtin exception, one of the packages', or any name ending in Error/Exception/Timeout), so only
    the modules defining one are imported: the engine adapters need engines not installed here."""
    builtin = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    defined: list[tuple[str, str, set[str]]] = []
    for folder in PACKAGES.values():
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    bases = {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                             if isinstance(b, (ast.Name, ast.Attribute))}
                    defined.append((_module_name(path), node.name, bases))
    known = set(builtin)
    while True:
        more = {name for _, name, bases in defined
                if bases & known or any(b.endswith(("Error", "Exception", "Timeout")) for b in bases)} - known
        if not more:
            break
        known |= more
    return [getattr(importlib.import_module(module), name) for module, name, _ in defined
            if name in known - builtin and not name.startswith("_")]  # a private one is caught where it is raised


def test_every_exception_class_of_the_packages_is_a_kvpool_error() -> None:
    classes = _exception_classes()
    assert {c.__name__ for c in classes} >= {"KVPoolError", "InvalidArgument", "CorruptBlock", "StreamError",
                                             "PayloadError"}
    assert [c for c in classes if not issubclass(c, KVPoolError)] == []
    timeouts = [c for c in classes if "Timeout" in c.__name__]
    assert timeouts and [c for c in timeouts if not issubclass(c, TimeoutError)] == []


# ----- (b) the source ---------------------------------------------------------------------------------------


def _broad(handler: ast.ExceptHandler) -> bool:
    """`except:`, `except Exception`, `except BaseException`, or a tuple naming one of them."""
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(k is None or (isinstance(k, ast.Name) and k.id in ("Exception", "BaseException")) for k in kinds)


def _own_nodes(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """The nodes of `body`, not descending into functions or classes defined there (they run later)."""
    todo: list[ast.AST] = list(body)
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))


def _handled(handler: ast.ExceptHandler) -> bool:
    """Whether a broad handler deals with what it caught: it raises (the same or a typed error), logs,
    or hands the exception on (to a callback, a future, a translation) by its name."""
    for node in _own_nodes(handler.body):
        if isinstance(node, ast.Raise):
            return True
        if isinstance(node, ast.Call) and _logs(node):
            return True
        if handler.name and isinstance(node, ast.Name) and node.id == handler.name:
            return True
    return False


def _logs(call: ast.Call) -> bool:
    """A logging call: `log.warning(...)` and the like, or a helper named for logging (`_log_crash`)."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in LOG_CALLS or "log" in name.lower()


def _raised_name(node: ast.Raise) -> str | None:
    exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
    return exc.id if isinstance(exc, ast.Name) else None


def _scan(path: Path, root: Path = REPO) -> Iterator[tuple[str, int, str, str]]:
    """(file relative to `root`, line, enclosing function, what) of each break of the contract in one
    source file."""
    tree = ast.parse(path.read_text(), str(path))
    rel = str(path.relative_to(root))

    def visit(node: ast.AST, func: str) -> Iterator[tuple[str, int, str, str]]:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else func
            if isinstance(child, ast.Raise) and _raised_name(child) in UNTYPED:
                yield rel, child.lineno, func, str(_raised_name(child))
            if isinstance(child, ast.ExceptHandler) and _broad(child) and not _handled(child):
                yield rel, child.lineno, func, "except"
            yield from visit(child, name)

    yield from visit(tree, "<module>")


def _breaks() -> list[str]:
    out = []
    for folder in PACKAGES.values():
        for path in sorted((REPO / folder).rglob("*.py")):
            for rel, line, func, what in _scan(path):
                if (rel, func, what) not in ALLOWED:
                    out.append(f"{rel}:{line} in {func}: " +
                               ("a broad except that neither raises, logs nor hands the error on" if what == "except"
                                else f"raise {what} (raise a KVPoolError subclass: core/errors.py, streams/errors.py)"))
    return out


def test_the_package_raises_only_typed_errors_and_swallows_nothing_silently() -> None:
    assert _breaks() == []


def test_the_scan_finds_what_it_looks_for(tmp_path: Path) -> None:
    """The scan itself: each kind of break is caught, and each way of handling passes."""
    src = tmp_path / "sample.py"
    src.write_text('''
def f():
    raise ValueError("x")
def g():
    raise KVPoolError("x")
def h():
    try:
        pass
    except Exception:
        pass
def i():
    try:
        pass
    except:
        x = 1
def ok():
    try:
        pass
    except Exception as e:
        report(e)
    try:
        pass
    except BaseException:
        cleanup()
        raise
    try:
        pass
    except Exception:
        log.warning("x")
    try:
        pass
    except OSError:
        pass
    raise InvalidArgument("x")
''')
    found = [(func, what) for _, _, func, what in _scan(src, tmp_path)]
    assert found == [("f", "ValueError"), ("g", "KVPoolError"), ("h", "except"), ("i", "except")]


def test_the_allowlist_names_only_sites_that_exist() -> None:
    """An allowance outlives its reason silently otherwise."""
    sites = {(rel, func, what) for folder in PACKAGES.values() for path in (REPO / folder).rglob("*.py")
             for rel, _, func, what in _scan(path)}
    assert set(ALLOWED) <= sites
    assert all(reason.strip() for reason in ALLOWED.values())


# ----- (c) the attributes -----------------------------------------------------------------------------------


def _cache() -> TieredCache:
    """A DRAM tier of 1 MiB slabs: its max block is 1 MiB."""
    return TieredCache(dram_bytes=8 * MiB, dram_slab_size=MiB, prefault=False)


def test_a_block_too_large_for_the_dram_tier_carries_key_size_and_limit() -> None:
    cache = _cache()
    try:
        with pytest.raises(BlockTooLarge) as info:
            cache.put("big", bytes(2 * MiB))
    finally:
        cache.close()
    assert info.value.key in ("big", b"big")
    assert (info.value.size, info.value.limit) == (2 * MiB, MiB)
    assert str(2 * MiB) in str(info.value)


def test_a_block_too_large_for_the_pool_carries_key_size_and_limit() -> None:
    with PoolClient(backend=MemoryBackend(max_block=MiB)) as pool, pytest.raises(BlockTooLarge) as info:
        pool.batch_put(["ok", "big"], [b"x", bytes(MiB + 1)])
    assert (info.value.key, info.value.size, info.value.limit) == (b"big", MiB + 1, MiB)


@pytest.mark.parametrize("call", ["cache.batch_put", "cache.batch_get_into", "client.batch_put",
                                  "client.batch_get_into"])
def test_lists_of_different_lengths_are_an_invalid_argument(call: str) -> None:
    """Still a ValueError, as engines that check their arguments expect."""
    cache = _cache()
    client = PoolClient(backend=MemoryBackend())
    owner, method = call.split(".")
    try:
        with pytest.raises(InvalidArgument, match="2 keys but 1 buffers") as info:
            getattr({"cache": cache, "client": client}[owner], method)(["a", "b"], [bytearray(4)])
    finally:
        client.close()
        cache.close()
    assert isinstance(info.value, ValueError)


def test_a_payload_block_that_fails_its_checksum_is_a_corrupt_payload_naming_the_block() -> None:
    with PoolClient(backend=MemoryBackend()) as pool:
        pool.put("p/0", b"wrong bytes")
        ref = Ref(["p/0"], [11], [checksum(memoryview(b"right bytes"))])
        with pytest.raises(CorruptPayload) as info:
            fetch(pool, ref)
        assert isinstance(info.value, PayloadError)
        assert (info.value.key, info.value.size) == ("p/0", 11)
        with pytest.raises(PayloadError) as missing:
            fetch(pool, Ref(["p/1"], [5], [0]))
        assert not isinstance(missing.value, CorruptPayload)
        assert (missing.value.key, missing.value.size) == ("p/1", 5)
