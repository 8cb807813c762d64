"""Run one SGLang instance against a KV store, serve prompts, and report tokens and storage hits.

Runs inside an SGLang environment (`python -m kvpool.backends.engines.envs install sglang`):

    python -m kvpool.backends.engines.sglang_run --model DIR --prompts PROMPTS.json \\
        [--store kvpool|kvpool-v1|mooncake|file|none] [--pool '{"nats_url": "nats://..."}'] \\
        [--server] [--max-tokens 16] [--cpu-stubs DIR]

PROMPTS.json is a list of token-id lists. Each prompt is served greedily, one after another, and
before each one the engine's device and host caches are flushed (which also waits for the previous
prompt's writes to the store): whatever a prompt reuses comes from the store. The last stdout line
is one JSON object: `{"engine": "sglang", "version": ..., "store": ..., "results": [{"tokens": [...],
"cached_tokens": N, "ttft_s": S}, ...]}`, where N is SGLang's `cached_tokens_details["storage"]`
(tokens loaded from the store) and S SGLang's own time to first token (`first_token_latency`, reported
under `--enable-metrics`, which the driver turns on; without it, the request's wall time). Engine logs
go to stderr.

Stores: `kvpool` is `--hicache-storage-backend dynamic` with `kvpool.backends.sglang.KVPoolHiCacheStorage`
(`kvpool-v1` the same with `interface_v1`); `mooncake` is SGLang's own Mooncake backend with kvpool's
`mooncake.store` drop-in first on PYTHONPATH; `file` is SGLang's file backend in `--file-dir`;
`none` is no hierarchical cache (every prompt recomputed). `--pool` holds PoolClient options.
On a machine without CUDA, SGLang 0.5.23 needs kvpool's test-only stand-ins (`tests/e2e/sglang_cpu`,
given by `--cpu-stubs` or `KVPOOL_SGLANG_CPU_STUBS`); they reach every SGLang process through PYTHONPATH.
`--pause-before I` prints `{"paused_before": I}` on stdout and waits for a line on stdin before
serving prompt I (a test kills the pool there).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from kvpool.backends.engines.scratch import private_tmp
from kvpool.backends.mooncake_shim import shim_path
from kvpool.core import BenchError

STORES = ("kvpool", "kvpool-v1", "mooncake", "file", "none")
PAGE_SIZE = 32
PREFETCH_THRESHOLD = 64
"""Tokens a prompt must have before SGLang consults the store (its default of 256 silently skips
shorter prompts)."""
_STUBS_ENV = "KVPOOL_SGLANG_CPU_STUBS"
_REEXEC_ENV = "KVPOOL_SGLANG_RUN_CHILD"
_FLUSH_TIMEOUT_S = 120.0
_READY_TIMEOUT_S = 300.0


def engine_args(store: str, pool: dict[str, Any], model: str, device: str, max_total_tokens: int,
                file_dir: str | None) -> dict[str, Any]:
    """SGLang `ServerArgs` fields for one instance (the same for `sglang.Engine` and the HTTP server)."""
    args: dict[str, Any] = dict(model_path=model, device=device, page_size=PAGE_SIZE, random_seed=0,
                                max_total_tokens=max_total_tokens, enable_metrics=True, log_level="info")
    if device == "cpu":  # SGLang's CPU path without its CPU kernel package (see ../shared/ENGINES.md)
        args.update(attention_backend="torch_native", sampling_backend="pytorch", disable_cuda_graph=True,
                    mem_fraction_static=0.3)
    if store == "none":
        return args
    extra: dict[str, Any] = {"prefetch_threshold": PREFETCH_THRESHOLD}
    if store in ("kvpool", "kvpool-v1"):
        backend = "dynamic"
        extra.update(backend_name="kvpool", module_path="kvpool.backends.sglang", class_name="KVPoolHiCacheStorage",
                     interface_v1=int(store == "kvpool-v1"), **pool)
    elif store == "mooncake":
        backend = "mooncake"
        extra["master_server_address"] = mooncake_address(pool)
    else:
        backend = "file"
        if not file_dir:
            raise SystemExit("sglang_run: --store file needs --file-dir")
        extra["file_storage_path"] = file_dir
    args.update(enable_hierarchical_cache=True, hicache_io_backend="direct", hicache_mem_layout="layer_first",
                hicache_write_policy="write_through", hicache_storage_prefetch_policy="wait_complete",
                hicache_storage_backend=backend, hicache_storage_backend_extra_config=json.dumps(extra))
    return args


def mooncake_address(pool: dict[str, Any]) -> str:
    """The `master_server_address` that makes kvpool's Mooncake drop-in reach the pool `pool` names."""
    if pool.get("nats_url"):
        return str(pool["nats_url"])
    if pool.get("worker"):
        return str(pool["worker"])
    return "embedded" if pool.get("mode", "embedded") == "embedded" else "kvpool"


def engine_env(store: str, pool: dict[str, Any], device: str, stubs: str | None) -> dict[str, str]:
    """The environment of every SGLang process of the instance."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if store == "mooncake":
        paths.insert(0, shim_path())
        # else SGLang first starts a Mooncake Transfer Engine (`mooncake.engine`) for the store to share
        env["SGLANG_HICACHE_MOONCAKE_REUSE_TE"] = "0"
        # the drop-in takes its other PoolClient options (token, timeout_s, ...) from KVPOOL_*
        env.update({f"KVPOOL_{k.upper()}": str(v) for k, v in pool.items() if k not in ("nats_url", "worker")})
    if device == "cpu":
        if not stubs:
            raise SystemExit(f"sglang_run: SGLang on CPU needs kvpool's test-only stand-ins: pass --cpu-stubs "
                             f"DIR or set {_STUBS_ENV} (DIR is tests/e2e/sglang_cpu of a kvpool checkout)")
        paths.insert(0, str(Path(stubs).resolve()))
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


class _Instance(Protocol):
    def generate(self, tokens: list[int], max_tokens: int) -> dict[str, Any]: ...
    def flush(self) -> None: ...


def _result(out: dict[str, Any], wall_s: float) -> dict[str, Any]:
    meta = out.get("meta_info", {})
    details = meta.get("cached_tokens_details") or {}
    ttft = meta.get("first_token_latency")
    return {"tokens": [int(t) for t in out["output_ids"]], "cached_tokens": int(details.get("storage", 0)),
            "ttft_s": float(ttft if ttft is not None else wall_s)}


def _sampling(max_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


class _Offline:
    """`sglang.Engine` in this process (its scheduler runs in child processes)."""

    def __init__(self, args: dict[str, Any]) -> None:
        import sglang
        self._engine = sglang.Engine(**args)

    def generate(self, tokens: list[int], max_tokens: int) -> dict[str, Any]:
        return dict(self._engine.generate(input_ids=tokens, sampling_params=_sampling(max_tokens)))

    def flush(self) -> None:
        deadline = time.monotonic() + _FLUSH_TIMEOUT_S
        while not self._engine.flush_cache().success:  # refused while store writes are in flight
            if time.monotonic() > deadline:
                raise BenchError(f"SGLang did not become idle (store writes pending) in {_FLUSH_TIMEOUT_S} s")
            time.sleep(0.2)

    def close(self) -> None:
        self._engine.shutdown()


class _Server:
    """`python -m sglang.launch_server` on 127.0.0.1, driven over HTTP."""

    def __init__(self, args: dict[str, Any], env: dict[str, str]) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(self.port),
               *_cli(args)]
        self.proc = subprocess.Popen(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"the SGLang server exited with status {self.proc.returncode} before it was ready")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{self.url}/health", timeout=30).read()  # 503 until warmed up
                return
            time.sleep(0.5)
        raise TimeoutError(f"the SGLang server was not ready in {_READY_TIMEOUT_S} s")

    def _post(self, path: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, bytes]:
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(f"{self.url}{path}", data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def generate(self, tokens: list[int], max_tokens: int) -> dict[str, Any]:
        status, body = self._post("/generate", {"input_ids": tokens, "sampling_params": _sampling(max_tokens)}, 600)
        if status != 200:
            raise BenchError(f"SGLang /generate answered {status}: {body[:500]!r}")
        return dict(json.loads(body))

    def flush(self) -> None:
        deadline = time.monotonic() + _FLUSH_TIMEOUT_S
        while self._post("/flush_cache", None, 60)[0] != 200:  # 400 while store writes are in flight
            if time.monotonic() > deadline:
                raise BenchError(f"SGLang did not become idle (store writes pending) in {_FLUSH_TIMEOUT_S} s")
            time.sleep(0.2)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the server stops its own scheduler and detokenizer
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers of the group (scheduler, detokenizer)
        self.proc.wait()


def _cli(args: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for k, v in args.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is not False and v is not None:
            out += [flag, str(v)]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[Any]:
    """Send everything written to fd 1 (SGLang and its child processes log there) to stderr, and
    yield a stream on the original stdout for the driver's own lines."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    out = os.fdopen(saved, "w", buffering=1)
    try:
        yield out
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        out.close()


def _serve(inst: _Instance, prompts: list[list[int]], max_tokens: int, pause_before: int | None,
           out: Any) -> list[dict[str, Any]]:
    results = []
    for i, tokens in enumerate(prompts):
        inst.flush()
        if i == pause_before:
            print(json.dumps({"paused_before": i}), file=out, flush=True)
            sys.stdin.readline()
        t0 = time.perf_counter()
        res = inst.generate(tokens, max_tokens)
        results.append(_result(res, time.perf_counter() - t0))
        print(f"[sglang_run] prompt {i}: {results[-1]['cached_tokens']} tokens from the store, "
              f"ttft {results[-1]['ttft_s']:.3f} s", file=sys.stderr, flush=True)
    inst.flush()  # the last prompt's store writes complete before the engine stops
    return results


_SGLANG_SHM = ("sglang_loads_",)
"""/dev/shm names SGLang's processes leave behind when it stops them with SIGKILL. (Not the
multiprocessing semaphores `sem.mp-*`: a live one is mapped only as a deleted file, so "no process
maps it" cannot tell a leftover from another program's semaphore that is being handed over.)"""


def _shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(_SGLANG_SHM)} if os.path.isdir("/dev/shm") else set()


def _in_use() -> set[str]:
    """/dev/shm names that a live process maps or holds open."""
    used: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            used.update(line.rsplit("/dev/shm/", 1)[1].split()[0] for line in maps if "/dev/shm/" in line)
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("/dev/shm/"):
                        used.add(target[len("/dev/shm/"):].split()[0])
    return used


def _sweep_shm(before: set[str], grace_s: float = 10.0) -> None:
    """Unlink what this instance's SGLang processes left in /dev/shm: names that appeared during
    the run and that no live process uses, waiting up to `grace_s` for processes still exiting to
    let go of theirs (a loaded machine may take seconds to reap them)."""
    deadline = time.monotonic() + grace_s
    while leaked := _shm_names() - before:
        for name in leaked - _in_use():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")
        if time.monotonic() > deadline:
            return
        time.sleep(0.5)


def _device(requested: str | None) -> str:
    if requested:
        return requested
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpool.backends.engines.sglang_run",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("--model", required=True, help="model folder")
    p.add_argument("--prompts", required=True, type=Path, help="JSON file: a list of token-id lists")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt (greedy)")
    p.add_argument("--store", choices=STORES, default="kvpool")
    p.add_argument("--pool", default="{}", help="PoolClient options as JSON, e.g. '{\"nats_url\": \"nats://...\"}'")
    p.add_argument("--server", action="store_true", help="an HTTP server on 127.0.0.1 instead of sglang.Engine")
    p.add_argument("--file-dir", help="directory of SGLang's file store (--store file)")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--max-total-tokens", type=int, default=8192, help="device KV capacity in tokens")
    p.add_argument("--cpu-stubs", default=os.environ.get(_STUBS_ENV), help=f"SGLang CPU stand-ins (${_STUBS_ENV})")
    p.add_argument("--pause-before", type=int, help="wait for a stdin line before serving this prompt index")
    args = p.parse_args(argv)

    pool = json.loads(args.pool)
    prompts = [[int(t) for t in ps] for ps in json.loads(args.prompts.read_text())]
    device = _device(args.device)
    env = engine_env(args.store, pool, device, args.cpu_stubs)
    if not args.server and os.environ.get(_REEXEC_ENV) != "1":
        # sglang.Engine runs in this process: start over with the instance's PYTHONPATH so that its
        # sitecustomize (CPU patches) and the mooncake shim apply here as in the children
        os.execve(sys.executable, [sys.executable, "-m", "kvpool.backends.engines.sglang_run",
                                   *(sys.argv[1:] if argv is None else argv)], {**env, _REEXEC_ENV: "1"})
    eargs = engine_args(args.store, pool, args.model, device, args.max_total_tokens, args.file_dir)
    t0 = time.monotonic()
    shm_before = _shm_names()
    with _stdout_to_stderr() as out, private_tmp(env):
        try:
            inst: _Offline | _Server = _Server(eargs, env) if args.server else _Offline(eargs)
            try:
                print(f"[sglang_run] {args.store} instance ready in {time.monotonic() - t0:.1f} s",
                      file=sys.stderr, flush=True)
                results = _serve(inst, prompts, args.max_tokens, args.pause_before, out)
            finally:
                inst.close()
        finally:
            _sweep_shm(shm_before)
        report = {"engine": "sglang", "version": importlib.metadata.version("sglang"), "store": args.store,
                  "server": bool(args.server), "results": results}
        print(json.dumps(report), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
