"""SGLang 0.5.23 serving from kvpool: real engine processes end to end (issue 10).

Every engine instance is its own process (`kvpool.backends.engines.sglang_run` in SGLang's venv, with
the CPU stand-ins of tests/e2e/sglang_cpu), sharing one `kvpool up` pool. Per path, instance A serves
a 300-token prompt (9 full pages of 32) and stores its KV; instance B, a new process, serves it again:
it loads at least all full pages but the last from the pool (SGLang's `cached_tokens_details["storage"]`)
and its greedy tokens equal A's. Each instance is one process of 20-35 s, so the checks share them:
- dynamic backend, `interface_v1` on: A, B (offline `sglang.Engine`), then the pool's blocks of the
  prompt are overwritten with random values of the same sizes and C, an HTTP server, loads as many
  tokens as B and answers different tokens (B used what it loaded); then the pool is killed while C
  runs and C serves the prompt again: recomputed, A's tokens, no exception;
- dynamic backend, `interface_v1` off (the tensor form): A an HTTP server, B offline;
- SGLang's own `mooncake` backend on kvpool's `mooncake.store` drop-in: A offline, B an HTTP server.
After each test's processes stop, no process of theirs is left and no kvpool object in /dev/shm.
"""
from __future__ import annotations

import getpass
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest

from kvpool.core.client import PoolClient

STUBS = Path(__file__).resolve().parent / "sglang_cpu"
PAGE = 32
PROMPT = [random.Random(10).randrange(3, 512) for _ in range(300)]
"""9 full pages and 12 tokens, in the tiny tokenizer's ids without pad/bos/eos."""
FULL_PAGES_BUT_LAST = (len(PROMPT) // PAGE - 1) * PAGE
MAX_TOKENS = 16
PROCESS_TIMEOUT_S = 300
TAG_ENV = "KVPOOL_E2E_SGLANG_TAG"

pytestmark = pytest.mark.timeout(900)  # engine processes, and the first use builds SGLang's venv


@dataclass
class Sglang:
    python: Path
    model: Path
    work: Path
    tag: str
    """in the environment of every engine process of the test, to find any left behind"""

    def command(self, store: str, pool: dict[str, Any], prompts: int, *, server: bool,
                pause_before: int | None = None) -> list[str]:
        path = self.work / f"prompts-{prompts}.json"
        path.write_text(json.dumps([PROMPT] * prompts))
        cmd = [str(self.python), "-m", "kvpool.backends.engines.sglang_run", "--model", str(self.model),
               "--prompts", str(path), "--store", store, "--pool", json.dumps(pool), "--device", "cpu",
               "--max-tokens", str(MAX_TOKENS), "--cpu-stubs", str(STUBS)]
        cmd += ["--server"] if server else []
        return cmd + ["--pause-before", str(pause_before)] if pause_before is not None else cmd

    def env(self) -> dict[str, str]:
        return {**os.environ, TAG_ENV: self.tag, "TMPDIR": str(self.scratch),
                "TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")}

    scratch: Path
    """the engines' TMPDIR, which each driver must leave as empty as it found it (short: the engines put
    IPC sockets in it, and a socket path has at most 107 bytes)"""

    def run(self, store: str, pool: dict[str, Any], *, server: bool = False) -> list[dict[str, Any]]:
        """One instance serving the prompt once: its results."""
        log = self.work / f"{store}-{uuid.uuid4().hex[:6]}.log"
        t0 = time.monotonic()
        with open(log, "wb") as err:
            proc = subprocess.run(self.command(store, pool, 1, server=server), env=self.env(), stdout=subprocess.PIPE,
                                  stderr=err, timeout=PROCESS_TIMEOUT_S, cwd=self.work)
        print(f"sglang --store {store}{' --server' if server else ''}: {time.monotonic() - t0:.1f} s", file=sys.stderr)
        return report(proc.returncode, proc.stdout.decode(), log)


def report(returncode: int, stdout: str, log: Path) -> list[dict[str, Any]]:
    lines = stdout.strip().splitlines()
    assert returncode == 0 and lines, f"sglang_run failed ({returncode}):\n{log.read_text(errors='replace')[-4000:]}"
    rep = json.loads(lines[-1])
    assert rep["engine"] == "sglang" and rep["version"] == "0.5.23"
    return list(rep["results"])


@pytest.fixture
def sglang(engine_python: Callable[[str], Path], tiny_model: Callable[..., Path], tmp_path: Path) -> Iterator[Sglang]:
    shm_before = _shm()
    eng = Sglang(engine_python("sglang"), tiny_model("sglang"), tmp_path, uuid.uuid4().hex,
                 Path(tempfile.mkdtemp(prefix="kve-")))
    yield eng
    assert not _leftover_processes(eng.tag), "engine processes outlived their driver"
    left_tmp = list(eng.scratch.iterdir())
    shutil.rmtree(eng.scratch)
    assert not left_tmp, f"engines left files in their TMPDIR: {left_tmp}"
    leaked = {n for n in _shm() - shm_before if not _owner_alive(n)}
    assert not leaked, f"left in /dev/shm: {sorted(leaked)}"


def _shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(("kvpool", "sglang_loads_"))}


def _owner_alive(name: str) -> bool:
    """Whether the process that created a pid-stamped kvpool object (kvpool-PID-...) still runs: the
    pool of another test on this machine, not a leak of this one."""
    m = re.match(r"kvpool-(\d+)-", name)
    return m is not None and Path(f"/proc/{m.group(1)}").exists()


def _leftover_processes(tag: str, grace_s: float = 10.0) -> list[int]:
    """Processes whose environment carries `tag`, after a grace period for exits under way."""
    needle = f"{TAG_ENV}={tag}".encode()
    deadline = time.monotonic() + grace_s
    while True:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if needle in Path(f"/proc/{pid}/environ").read_bytes():
                    found.append(int(pid))
            except OSError:
                pass
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def assert_loaded_and_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["cached_tokens"] == 0, "instance A found the prompt in a fresh pool"
    assert b["cached_tokens"] >= FULL_PAGES_BUT_LAST, f"B loaded {b['cached_tokens']} tokens from the pool"
    assert len(a["tokens"]) == MAX_TOKENS
    assert b["tokens"] == a["tokens"]


# ----- the dynamic kvpool backend -----------------------------------------------------------------


def test_dynamic_v1_loads_what_a_stored_and_survives_the_pool(sglang: Sglang, pool_up: Any) -> None:
    pool = {"nats_url": pool_up.nats_url, "timeout_s": 2.0}
    a = sglang.run("kvpool-v1", pool)[0]
    b = sglang.run("kvpool-v1", pool)[0]
    assert_loaded_and_equal(a, b)

    names = v1_block_names(sglang, b["cached_tokens"] // PAGE)
    overwrite_with_random_values(pool_up.nats_url, names)

    log = sglang.work / "c.log"
    with open(log, "wb") as err:
        c = subprocess.Popen(sglang.command("kvpool-v1", pool, 2, server=True, pause_before=1), env=sglang.env(),
                             cwd=sglang.work, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            assert c.stdout is not None and c.stdin is not None
            paused = wait_for_pause(c.stdout)
            assert paused == {"paused_before": 1}, f"C did not pause:\n{log.read_text(errors='replace')[-4000:]}"
            log_at_kill = log.stat().st_size
            pool_up.kill()
            c.stdin.write("\n")
            c.stdin.flush()
            rest, _ = c.communicate(timeout=PROCESS_TIMEOUT_S)
        finally:
            if c.poll() is None:
                c.kill()
                c.wait()
    corrupt, after_kill = report(c.returncode, rest, log)

    # negative control: the same pages came from the pool, and what they held decided the tokens
    assert corrupt["cached_tokens"] == b["cached_tokens"]
    assert corrupt["tokens"] != a["tokens"]
    # the pool gone: the server recomputes, right, without an exception
    assert after_kill["cached_tokens"] == 0
    assert after_kill["tokens"] == a["tokens"]
    after = log.read_bytes()[log_at_kill:].decode(errors="replace")
    assert "Traceback" not in after, after[-4000:]


def test_dynamic_tensor_form_loads_what_a_stored(sglang: Sglang, pool_up: Any) -> None:
    pool = {"nats_url": pool_up.nats_url}
    a = sglang.run("kvpool", pool, server=True)[0]
    b = sglang.run("kvpool", pool)[0]
    assert_loaded_and_equal(a, b)


# ----- SGLang's own Mooncake backend on kvpool's drop-in ------------------------------------------


def test_mooncake_backend_on_the_dropin_loads_what_a_stored(sglang: Sglang, pool_up: Any) -> None:
    pool = {"nats_url": pool_up.nats_url}
    a = sglang.run("mooncake", pool)[0]
    b = sglang.run("mooncake", pool, server=True)[0]
    assert_loaded_and_equal(a, b)


# ----- helpers of the negative control ------------------------------------------------------------


def page_hashes(sglang: Sglang, pages: int) -> list[str]:
    """SGLang's own storage keys of the prompt's first `pages` pages (its chained page hash)."""
    code = ("import json, sys; from sglang.srt.mem_cache.utils import get_hash_str; "
            f"t = json.load(sys.stdin); print(json.dumps(get_hash_str(t, None, page_size={PAGE})))")
    env = {**os.environ, TAG_ENV: sglang.tag, "PYTHONPATH": str(STUBS), "SGLANG_USE_CPU_ENGINE": "1"}
    out = subprocess.run([str(sglang.python), "-c", code], input=json.dumps(PROMPT[:pages * PAGE]), text=True,
                         capture_output=True, env=env, timeout=PROCESS_TIMEOUT_S, check=True)
    hashes: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return hashes


def v1_block_names(sglang: Sglang, pages: int) -> list[str]:
    """Pool keys of the prompt's pages as KVPoolHiCacheStorage's v1 path writes them on this model:
    `sglang/<model>/tp0of1/<layout>/<dtype>/<page hash>.<j>`, one object per layer and K/V."""
    layers = json.loads((sglang.model / "config.json").read_text())["num_hidden_layers"]
    prefix = f"sglang/{sglang.model}/tp0of1/layer_first/bfloat16/"
    return [f"{prefix}{h}.{j}" for h in page_hashes(sglang, pages) for j in range(2 * layers)]


def overwrite_with_random_values(nats_url: str, names: list[str]) -> None:
    """Replace each block with random finite bf16 values of the same size."""
    rng = np.random.default_rng(0)
    with PoolClient(nats_url=nats_url) as pool:
        old = [pool.get(n) for n in names]
        missing = [n for n, v in zip(names, old) if v is None]
        assert not missing, f"{len(missing)} of {len(names)} expected blocks are not in the pool, e.g. {missing[0]}"
        for name, value in zip(names, old):
            assert value is not None
            bits = rng.standard_normal(len(value) // 2, dtype=np.float32).view(np.uint32) >> 16
            pool.put(name, bits.astype(np.uint16).tobytes())


def wait_for_pause(stdout: IO[str]) -> dict[str, Any] | None:
    """The driver's pause line, or None when it ended without one."""
    for line in stdout:
        if line.startswith('{"paused_before"'):
            parsed: dict[str, Any] = json.loads(line)
            return parsed
        print(line, end="", file=sys.stderr)
    return None
