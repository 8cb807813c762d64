"""What the lab's benches share: the parent process that builds the lab and runs the measuring command,
workers started on lab hosts and waited for, and a bench run as a test."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from netlab import Lab, can_build


def bench_main(name: str, hosts: int, setup: Callable[[Lab, str], list[str] | None]) -> int:
    """A lab bench's parent: a lab of `hosts` hosts (status 2 where none can be built here); `setup(lab,
    work folder)` starts its services and returns the measuring command (None: a service failed, status
    1); that command's last line is printed, its standard error passed on, and its status returned."""
    why_not = can_build()
    if why_not:
        print(f"{name}: {why_not}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix=f"kvpool-{name}-") as work:
        lab = Lab(hosts, Path(work))
        try:
            cmd = setup(lab, work)
            if cmd is None:
                return 1
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                                 env={**os.environ, "KVPOOL_STATE_DIR": f"{work}/state"})
            sys.stderr.write(out.stderr)
            print(out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "", flush=True)
            return out.returncode
        finally:
            lab.close()


def start_workers(lab: Lab, hosts: Sequence[str], work: str, token: str, *args: str) -> bool:
    """A `kvpool worker` on each of `hosts` (port 7461, its address, a state folder of its own under
    `work`), with `args`: True once every one serves; False after 60 s, their logs on standard error."""
    logs = [f"worker-{h}.log" for h in hosts]
    for h, log in zip(hosts, logs):
        lab.spawn(h, [sys.executable, "-m", "kvpool.core.cli", "worker", "--host", lab.addr(h), "--port", "7461",
                      "--token", token, *args], log=log, env={"KVPOOL_STATE_DIR": f"{work}/state-{h}"})
    deadline = time.monotonic() + 60
    while not all("kvpool worker " in lab.log(log) for log in logs):
        if time.monotonic() > deadline:
            print(*(lab.log(log) for log in logs), sep="\n", file=sys.stderr)
            return False
        time.sleep(0.2)
    return True


def run_quick(script: Path, timeout: float) -> dict[str, Any]:
    """Run a lab bench with `--quick` (skipping the test where no lab can be built here); its JSON line."""
    why_not = can_build()
    if why_not:
        pytest.skip(f"multihost tests: {why_not}")
    out = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))
