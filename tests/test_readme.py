"""The README's set-up commands are what CI runs: a newcomer who copies them gets the tested set-up."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    """The command lines of the README's first shell block (comments dropped)."""
    block = re.search(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README.md has no ```sh block of set-up commands"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_readme_opens_with_two_setup_commands() -> None:
    commands = _readme_commands()
    assert len(commands) == 2, commands
    assert "kvpool bench cache" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_commands_verbatim() -> None:
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in _readme_commands():
        assert command in ci_lines, f"README command not run by .ci/run: {command}"
