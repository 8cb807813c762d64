"""Send one long prompt to SGLang instance A, then to instance B, and show that B read its prefix from kvpool.

A computes the prompt's KV cache and (write-through) backs its pages up to kvpool; B has never seen
the prompt, so any prefix it reuses came from the pool: `meta_info.cached_tokens_details.storage` in
B's /generate response, and `sglang:cached_tokens_total{cache_source="storage"}` /
`sglang:prefetched_tokens_total` on B's /metrics (the instances run with --enable-metrics; see
launch.sh). Standard library only. Exit status 0 when B got tokens from storage.

    python examples/sglang/same_prompt_twice.py --a http://127.0.0.1:30000 --b http://127.0.0.1:30001
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from typing import Any

STORAGE_METRICS = ('sglang:cached_tokens_total{cache_source="storage"}', "sglang:prefetched_tokens_total",
                   "sglang:storage_prefetch_hit_tokens_total")


def prompt(words: int) -> str:
    """A prompt of about 1.3 tokens per word, far above SGLang's prefetch threshold (256 tokens)."""
    body = " ".join(f"item-{i} weighs {i * 37 % 101} grams;" for i in range(words // 4))
    return f"Here is an inventory. {body}\nWhich item is the heaviest? Answer with its name."


def generate(url: str, text: str) -> dict[str, Any]:
    req = urllib.request.Request(f"{url}/generate", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"text": text, "sampling_params": {"max_new_tokens": 16,
                                                                                    "temperature": 0}}).encode())
    with urllib.request.urlopen(req, timeout=600) as resp:
        return dict(json.load(resp)["meta_info"])


def metrics(url: str) -> dict[str, float]:
    """The storage metrics of one instance, summed over ranks (a metric absent so far is 0)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        lines = resp.read().decode().splitlines()
    found = dict.fromkeys(STORAGE_METRICS, 0.0)
    for line in lines:
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        for wanted in STORAGE_METRICS:
            name, _, label = wanted.partition("{")
            if series.split("{")[0] == name and label.rstrip("}") in series:
                found[wanted] += float(value)
    return found


def report(name: str, meta: dict[str, Any]) -> None:
    print(f"{name}: prompt_tokens={meta.get('prompt_tokens')} cached_tokens={meta.get('cached_tokens')} "
          f"details={meta.get('cached_tokens_details')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", default="http://127.0.0.1:30000", help="instance that computes the prompt")
    ap.add_argument("--b", default="http://127.0.0.1:30001", help="instance that should read it from kvpool")
    ap.add_argument("--words", type=int, default=2000)
    ap.add_argument("--wait", type=float, default=3.0, help="seconds for A's backup to reach the pool")
    args = ap.parse_args()

    text = prompt(args.words)
    before = metrics(args.b)
    report("A, first time ", generate(args.a, text))
    time.sleep(args.wait)
    report("A, second time", generate(args.a, text))  # a device-cache hit on A itself
    meta = generate(args.b, text)
    report("B, first time ", meta)
    after = metrics(args.b)
    for name in STORAGE_METRICS:
        print(f"B {name}: +{after[name] - before[name]:.0f}")
    from_storage = int((meta.get("cached_tokens_details") or {}).get("storage") or 0)
    print(f"B reused {from_storage} prompt tokens from kvpool" if from_storage else
          "B reused nothing from kvpool: is the pool shared (same nats_url), the prompt above the prefetch "
          "threshold, and --wait long enough for A's backup?")
    return 0 if from_storage > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
