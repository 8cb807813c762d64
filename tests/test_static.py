"""The type checker and the linter, run the way CI runs the tests (`python -m pytest`): mypy --strict over
kvpool.core, kvpool.backends and kvpool.streams, and ruff over the repository, both as configured in
pyproject.toml ([tool.mypy], [tool.ruff]). A failure prints what they found."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _check(*args: str) -> None:
    """Run `python -m <args>` from the repository root (where pyproject.toml is) and require a clean exit."""
    out = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.fail(f"`python -m {' '.join(args)}` exited {out.returncode}:\n{out.stdout}{out.stderr}", pytrace=False)


def test_ruff() -> None:
    _check("ruff", "check", ".")


@pytest.mark.timeout(600)  # the first run (a clean clone in CI) analyses torch and numpy: about a minute
def test_mypy() -> None:
    _check("mypy")  # the packages and options come from [tool.mypy]


def test_mypy_sees_every_package() -> None:
    """typecheck/kvpool/ mirrors the package-dir mapping (mypy cannot follow the editable install), and each
    package ships py.typed: a package added to pyproject.toml but not here would go unchecked."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    assert sorted(config["tool"]["mypy"]["packages"]) == sorted(mapping)
    for package, folder in mapping.items():
        link = ROOT / "typecheck" / Path(*package.split("."))
        assert link.is_symlink() and link.resolve() == (ROOT / folder).resolve(), f"{link} should link to {folder}/"
        assert (ROOT / folder / "py.typed").is_file(), f"{folder}/py.typed is missing"
        assert "py.typed" in config["tool"]["setuptools"]["package-data"][package]
