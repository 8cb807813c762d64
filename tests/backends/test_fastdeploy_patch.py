"""`kvpool fastdeploy enable|disable|status` against verbatim copies of the FastDeploy files it edits."""
from __future__ import annotations

import argparse
import ast
import json
import shutil
import sys
from pathlib import Path

import pytest

from kvpool.backends import fastdeploy_patch as fp

from bkhelp import FASTDEPLOY_SRC


@pytest.fixture
def fdpkg(tmp_path: Path) -> Path:
    """A copy of the FastDeploy fixture package, free to edit."""
    dst = tmp_path / "site-packages" / "fastdeploy"
    shutil.copytree(FASTDEPLOY_SRC, dst)
    return dst


def files(pkg: Path) -> dict[str, bytes]:
    return {rel: (pkg / rel).read_bytes() for rel in fp._PATCHES}


def choices_of(source: str, flag: str) -> list[str]:
    """The `choices` literal of the add_argument call that defines `flag`."""
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                and node.args[0].value == flag):
            kw = next(k for k in node.keywords if k.arg == "choices")
            return list(ast.literal_eval(kw.value))
    raise AssertionError(f"no {flag} argument")


def test_enable_twice_is_enable_once_and_disable_restores_the_bytes(fdpkg: Path) -> None:
    original = files(fdpkg)
    assert fp.status(fdpkg).state == "disabled"
    first = fp.enable(fdpkg)
    assert first.changed and first.state == "enabled"
    patched = files(fdpkg)
    assert patched != original
    second = fp.enable(fdpkg)
    assert not second.changed and "already enabled" in str(second)
    assert files(fdpkg) == patched
    assert fp.status(fdpkg).state == "enabled"
    off = fp.disable(fdpkg)
    assert off.changed and off.state == "disabled"
    assert files(fdpkg) == original
    assert not fp.disable(fdpkg).changed
    assert files(fdpkg) == original


def test_every_added_line_is_marked_and_every_replaced_line_kept(fdpkg: Path) -> None:
    original = files(fdpkg)
    fp.enable(fdpkg)
    for rel, before in original.items():
        after = (fdpkg / rel).read_text(encoding="utf-8")
        old_lines = before.decode().splitlines()
        new_lines = after.splitlines()
        unmarked = [ln for ln in new_lines if not ln.endswith(fp.MARK) and not ln.startswith(fp.WAS)]
        assert unmarked == [ln for ln in old_lines if ln not in
                            {w[len(fp.WAS):] for w in new_lines if w.startswith(fp.WAS)}]
        ast.parse(after)  # still valid Python


def test_patched_sources_accept_kvpool_everywhere_it_is_needed(fdpkg: Path) -> None:
    report = fp.enable(fdpkg)
    args_src = (fdpkg / fp.ARGS_FILE).read_text(encoding="utf-8")
    ctm_src = (fdpkg / fp.MANAGER_FILE).read_text(encoding="utf-8")
    assert choices_of(args_src, "--kvcache-storage-backend") == ["mooncake", "attention_store", "file", "kvpool"]
    assert choices_of(ctm_src, "--kvcache_storage_backend") == ["mooncake", "attention_store", "file", "kvpool"]
    assert ctm_src.count('storage_backend_type in ("mooncake", "file", "kvpool")') == 3  # read, query, write-back
    assert 'storage_backend_type not in ["mooncake", "kvpool"]' in ctm_src           # block_wise_fp8 check
    assert 'storage_backend_type == ("mooncake", "file")' in ctm_src                  # upstream's own line left alone
    assert "KVPoolStore(namespace=" in ctm_src
    changes = [c for f in report.files for c in f.changes]
    assert len(changes) == 7 and all(c.startswith("line ") for c in changes)


def test_patched_manager_parser_accepts_kvpool(fdpkg: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def parse(argv: list[str]) -> argparse.Namespace:
        tree = ast.parse((fdpkg / fp.MANAGER_FILE).read_text(encoding="utf-8"))
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "parse_args")
        ns: dict[str, object] = {"argparse": argparse, "json": json}
        exec(compile(ast.Module([fn], []), str(fdpkg / fp.MANAGER_FILE), "exec"), ns)
        monkeypatch.setattr(sys, "argv", ["cache_transfer_manager.py", *argv])
        return ns["parse_args"]()  # type: ignore[operator,no-any-return]

    with pytest.raises(SystemExit):
        parse(["--kvcache_storage_backend", "kvpool"])
    fp.enable(fdpkg)
    assert parse(["--kvcache_storage_backend", "kvpool"]).kvcache_storage_backend == "kvpool"
    assert parse(["--kvcache_storage_backend", "mooncake"]).kvcache_storage_backend == "mooncake"


def test_unknown_source_is_refused_and_nothing_is_written(fdpkg: Path) -> None:
    ctm = fdpkg / fp.MANAGER_FILE
    ctm.write_text(ctm.read_text(encoding="utf-8").replace('raise NotImplementedError(f"Unsupported storage backend',
                                                           'raise RuntimeError(f"Unknown storage backend'),
                   encoding="utf-8")
    before = files(fdpkg)
    with pytest.raises(fp.PatchError, match="Unsupported storage backend"):
        fp.enable(fdpkg)
    assert files(fdpkg) == before
    with pytest.raises(fp.PatchError, match="not a FastDeploy package"):
        fp.enable(fdpkg.parent / "nothing-here")


def test_outdated_patch_is_reported_and_enable_rewrites_it(fdpkg: Path) -> None:
    original = files(fdpkg)
    fp.enable(fdpkg)
    ctm = fdpkg / fp.MANAGER_FILE
    lines = ctm.read_text(encoding="utf-8").splitlines(keepends=True)
    ctm.write_text("".join(ln for ln in lines if "Initialized kvpool store" not in ln),
                   encoding="utf-8")  # as an older kvpool might have left it
    assert fp.status(fdpkg).state == "partial"
    assert fp.enable(fdpkg).changed and fp.status(fdpkg).state == "enabled"
    fp.disable(fdpkg)
    assert files(fdpkg) == original


def test_crlf_files_round_trip(fdpkg: Path) -> None:
    args = fdpkg / fp.ARGS_FILE
    args.write_bytes(args.read_bytes().replace(b"\n", b"\r\n"))
    original = files(fdpkg)
    fp.enable(fdpkg)
    assert b'"file", "kvpool"],  # kvpool\r\n' in args.read_bytes()
    fp.disable(fdpkg)
    assert files(fdpkg) == original


def test_file_mode_is_kept(fdpkg: Path) -> None:
    args = fdpkg / fp.ARGS_FILE
    args.chmod(0o640)
    fp.enable(fdpkg)
    assert args.stat().st_mode & 0o777 == 0o640
    assert not list(args.parent.glob("*.kvpool-tmp"))


def test_package_is_found_from_a_parent_dir_or_the_import_system(fdpkg: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert fp.find_package(fdpkg.parent) == fdpkg.resolve()
    monkeypatch.syspath_prepend(str(fdpkg.parent))
    assert fp.find_package() == fdpkg.resolve()


def test_command_line(fdpkg: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="kvpool")
    fp.add_parser(parser.add_subparsers(dest="command", required=True))

    def run(*argv: str) -> tuple[int, str]:
        args = parser.parse_args(list(argv))
        rc = args.func(args)
        return rc, capsys.readouterr().out + capsys.readouterr().err

    rc, out = run("fastdeploy", "status", "--path", str(fdpkg))
    assert rc == 1 and "disabled" in out and 'choices += "kvpool"' in out
    rc, out = run("fastdeploy", "enable", "--path", str(fdpkg))
    assert rc == 0 and ": enabled" in out and "branch constructing KVPoolStore" in out
    rc, out = run("fastdeploy", "status", "--path", str(fdpkg))
    assert rc == 0 and ": enabled" in out
    rc, out = run("fastdeploy", "disable", "--path", str(fdpkg))
    assert rc == 0 and "restored the originals" in out
    rc, _ = run("fastdeploy", "enable", "--path", str(fdpkg.parent / "missing"))
    assert rc == 1
