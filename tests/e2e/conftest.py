"""Fixtures of the end-to-end tests: real engine processes (each in its own virtual environment, built
once per machine by `kvpool.backends.engines.envs`), a tiny local model, and a `kvpool up` pool."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool.backends.engines import envs

ROOT = Path(__file__).resolve().parents[2]
ENVS = envs.envs_root()
"""Read at import: the autouse fixture of tests/conftest.py clears KVPOOL_* variables before each test."""
SGLANG_CPU_STUBS = Path(__file__).resolve().parent / "sglang_cpu"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.e2e)


def shm_objects() -> set[str]:
    """Every kvpool shared-memory object on this machine."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("kvpool")}


@pytest.fixture(scope="session")
def engine_python(pytestconfig: pytest.Config) -> Callable[[str], Path]:
    """engine_python(name) -> that engine's python; the first call on a machine builds its venv
    (minutes; progress goes to the terminal)."""
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")

    def _get(name: str) -> Path:
        py = envs.find_python(name, ENVS)
        if py is not None:
            envs.ensure(name, ROOT, ENVS)  # cheap: re-points kvpool at this checkout if needed
            return py
        with capture.global_and_fixture_disabled():
            return envs.ensure(name, ROOT, ENVS)

    return _get


@pytest.fixture(scope="session")
def tiny_model(engine_python: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
               ) -> Callable[..., Path]:
    """tiny_model(engine, preset="tiny") -> a model folder written by that engine's own transformers
    (engines disagree on config formats), built once per session."""
    built: dict[tuple[str, str], Path] = {}

    def _get(engine: str, preset: str = "tiny") -> Path:
        if (engine, preset) not in built:
            out = tmp_path_factory.mktemp(f"model-{engine}-{preset}")
            subprocess.run([str(engine_python(engine)), "-m", "kvpool.backends.engines.tiny_model", str(out),
                            "--preset", preset], check=True, capture_output=True, timeout=300)
            built[(engine, preset)] = out
        return built[(engine, preset)]

    return _get


class UpPool:
    """`kvpool up` (nats-server + one worker) on free ports with a private state dir."""

    def __init__(self, state_dir: Path, dram: str = "512MiB") -> None:
        self.state_dir = state_dir
        self.log_path = state_dir / "up.log"
        state_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "KVPOOL_STATE_DIR": str(state_dir)}
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - the service's output, for its lifetime (closed in stop)
        self.proc = subprocess.Popen([sys.executable, "-m", "kvpool.core.cli", "up", "--nats-port", "0",
                                      "--port", "0", "--dram-bytes", dram],
                                     env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.nats_url = self._wait_url(60.0)

    def _wait_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"kvpool is up: NATS (nats://\S+),", self.log())
            if m:
                return m.group(1).rstrip(",")
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"kvpool up did not start: {self.log()[-2000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """kill -9 the pool (its worker and nats-server), and remove the arena it could not unlink."""
        self._signal(signal.SIGKILL)
        for name in shm_objects():
            if name.startswith(f"kvpool-{self.proc.pid}-"):
                os.unlink(f"/dev/shm/{name}")

    def stop(self) -> None:
        """SIGTERM, as Ctrl-C would; kill -9 after 20 s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # the group: nats-server is its child
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()


@pytest.fixture
def pool_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[UpPool]:
    """The pool, and its state folder as this test's and its engines' (KVPOOL_STATE_DIR): there they
    find the NATS credentials and the worker token `kvpool up` made, as its user's processes do."""
    pool = UpPool(tmp_path / "pool")
    monkeypatch.setenv("KVPOOL_STATE_DIR", str(tmp_path / "pool"))
    yield pool
    pool.stop()
