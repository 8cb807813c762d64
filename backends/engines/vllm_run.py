"""Run one vLLM instance on a list of token-id prompts (greedy) and report tokens, cached tokens and TTFT.

Runs inside the vLLM environment (`python -m kvpool.backends.engines.envs install vllm`):

    python -m kvpool.backends.engines.vllm_run --model DIR --prompts prompts.json \
        [--store kvpool|file|none] [--pool '{"nats_url": "nats://..."}'] [--server] [--max-tokens 16]

Offline `vllm.LLM` by default; `--server` starts vLLM's OpenAI server on 127.0.0.1 and sends each prompt
to /v1/completions. Prompts are served one at a time, in order. The last stdout line is one JSON object:
`{"engine": "vllm", "version": ..., "mode": ..., "store": ..., "results": [{"tokens": [...],
"cached_tokens": N, "ttft_s": s}, ...]}`. cached_tokens: `RequestOutput.num_cached_tokens` (server:
`usage.prompt_tokens_details.cached_tokens`); ttft_s: vLLM's own time to first token (offline:
`RequestOutput.metrics.first_token_latency`; server: the growth of `vllm:time_to_first_token_seconds_sum`
on /metrics; where vLLM reports none, the request's wall time, an upper bound). Decoding is greedy with
`ignore_eos`, so every result has `--max-tokens` tokens. `--pause-after K[,K2]` prints `{"paused": K}`
after the K-th prompt and waits for a line on stdin before the next (tests use it to kill the pool
under a running engine).
"""
from __future__ import annotations

import argparse
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
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvpool.backends.engines.scratch import private_tmp

ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
              "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}
"""Defaults for the engine's environment (an existing value wins): 1 GiB of KV cache, no hub."""

SERVER_START_S = 240.0


def kv_transfer(store: str, pool: dict[str, Any], file_dir: str | None) -> dict[str, Any] | None:
    """vLLM's `kv_transfer_config` for `store` (None for "none")."""
    if store == "kvpool":
        return {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.backends.vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": pool}
    if store == "file":
        if not file_dir:
            raise SystemExit("--store file needs --file-dir DIR")
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": file_dir}}
    return None


def _pause(i: int, after: list[int]) -> None:
    if i in after:
        print(json.dumps({"paused": i}), flush=True)
        sys.stdin.readline()


# ----- offline LLM -----------------------------------------------------------------------------

def run_offline(args: argparse.Namespace, prompts: list[list[int]], kvt: dict[str, Any] | None) -> list[dict[str, Any]]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(model=str(args.model), enforce_eager=True, block_size=args.block_size, seed=0,
              max_model_len=args.max_model_len, disable_log_stats=False,
              enable_prefix_caching=not args.no_prefix_caching,
              kv_transfer_config=KVTransferConfig(**kvt) if kvt else None)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results = []
    try:
        for i, p in enumerate(prompts):
            _pause(i, args.pause_after)
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
            wall = time.perf_counter() - t0
            ttft = getattr(out.metrics, "first_token_latency", 0.0) or 0.0
            results.append({"tokens": list(out.outputs[0].token_ids), "cached_tokens": int(out.num_cached_tokens or 0),
                            "ttft_s": float(ttft) if ttft > 0 else wall})
    finally:
        llm.llm_engine.engine_core.shutdown()
    return results


# ----- OpenAI server ---------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server(args: argparse.Namespace, kvt: dict[str, Any] | None) -> Iterator[str]:
    """vLLM's OpenAI server on 127.0.0.1, its logs on our stderr; the base URL once /health answers.
    The whole process group is stopped on exit (SIGTERM, then SIGKILL after 20 s)."""
    port = args.port or _free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model),
           "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--block-size", str(args.block_size),
           "--seed", "0", "--max-model-len", str(args.max_model_len), "--enable-prompt-tokens-details"]
    if kvt:
        cmd += ["--kv-transfer-config", json.dumps(kvt)]
    if args.no_prefix_caching:
        cmd.append("--no-enable-prefix-caching")
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"vLLM server exited with {proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise SystemExit(f"vLLM server not ready after {SERVER_START_S:.0f} s")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        yield url
    finally:
        _stop_group(proc)


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, wait for every member to exit (20 s), then SIGKILL what is left."""
    _killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline and _killpg(proc.pid, 0):
        proc.poll()  # reap the leader so the group can empty
        time.sleep(0.2)
    _killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _killpg(pgid: int, sig: int) -> bool:
    """Signal the group; False when no process is left in it."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        reply: dict[str, Any] = json.loads(r.read())  # the server's JSON object
        return reply


def _ttft_sum(url: str) -> float | None:
    """Sum of vLLM's time-to-first-token histogram (seconds), or None when /metrics has none."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    sums = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("vllm:time_to_first_token_seconds_sum")]
    return sum(sums) if sums else None


def run_server(args: argparse.Namespace, prompts: list[list[int]], kvt: dict[str, Any] | None) -> list[dict[str, Any]]:
    results = []
    with server(args, kvt) as url:
        for i, p in enumerate(prompts):
            _pause(i, args.pause_after)
            before = _ttft_sum(url)
            t0 = time.perf_counter()
            out = _post(url + "/v1/completions", {"model": str(args.model), "prompt": p, "max_tokens": args.max_tokens,
                                                  "temperature": 0.0, "ignore_eos": True, "return_token_ids": True},
                        timeout=args.request_timeout)
            wall = time.perf_counter() - t0
            after = _ttft_sum(url)
            details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
            ttft = after - before if before is not None and after is not None and after > before else wall
            results.append({"tokens": list(out["choices"][0].get("token_ids") or []),
                            "cached_tokens": int(details.get("cached_tokens") or 0), "ttft_s": ttft})
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpool.backends.engines.vllm_run",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="model folder")
    p.add_argument("--prompts", type=Path, required=True, help="JSON file: a list of token-id lists")
    p.add_argument("--store", choices=["kvpool", "file", "none"], default="kvpool")
    p.add_argument("--pool", default="{}", help="PoolClient options as JSON, e.g. '{\"nats_url\": ...}'")
    p.add_argument("--file-dir", help="--store file: ExampleConnector's shared_storage_path")
    p.add_argument("--server", action="store_true", help="serve through the OpenAI HTTP server")
    p.add_argument("--port", type=int, default=0, help="--server port (default: a free one)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--pause-after", type=lambda v: [int(x) for x in v.split(",")], default=[],
                   help="K[,K2...]: after K prompts, print {\"paused\": K} and read a line from stdin")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="turn vLLM's own prefix cache off (a repeated prompt then loads from the store again)")
    args = p.parse_args(argv)
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    prompts = json.loads(args.prompts.read_text())
    kvt = kv_transfer(args.store, json.loads(args.pool), args.file_dir)
    t0 = time.perf_counter()
    with private_tmp():
        results = (run_server if args.server else run_offline)(args, prompts, kvt)
    import vllm

    print(json.dumps({"engine": "vllm", "version": vllm.__version__, "mode": "server" if args.server else "offline",
                      "store": args.store, "wall_s": round(time.perf_counter() - t0, 3), "results": results}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
