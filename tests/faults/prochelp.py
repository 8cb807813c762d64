"""What the tests of child processes share: a process's children (from /proc) and whether a pid lives."""
from __future__ import annotations

import os
from pathlib import Path


def children(pid: int) -> dict[int, str]:
    """The live children of `pid`, each with its command line."""
    out: dict[int, str] = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            if int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out[int(p)] = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            pass
    return out


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
