"""The engine environments get kvpool's own runtime dependencies: kvpool is installed into them with
--no-deps, so a dependency missing from the recipe breaks every pool call inside the engine (the
engine keeps running and only misses: nothing else would show it but the e2e tests)."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

from kvpool.backends.engines import envs


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()


def test_every_runtime_dependency_of_kvpool_is_in_the_engine_recipes() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    needed = {_name(r) for r in pyproject["project"]["dependencies"]} - envs.ENGINE_PROVIDED
    for engine, steps in envs.RECIPES.items():
        installed = {_name(a) for step in steps if step[0] == "install" for a in step[1:] if not a.startswith("-")}
        assert needed <= installed, f"{engine}'s environment lacks {sorted(needed - installed)}"
