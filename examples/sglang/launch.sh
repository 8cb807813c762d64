#!/usr/bin/env bash
# Two SGLang instances (one GPU each) sharing one kvpool as their HiCache L3 storage.
# Start the pool first, in another terminal:  kvpool up     (NATS on 127.0.0.1:4222 + one worker)
# Then: examples/sglang/launch.sh [MODEL]; and when both answer /health: python examples/sglang/same_prompt_twice.py
set -euo pipefail
MODEL=${1:-Qwen/Qwen3-8B}
CONFIG="$(cd "$(dirname "$0")" && pwd)/kvpool.json"

launch() {  # $1 = GPU, $2 = port
  CUDA_VISIBLE_DEVICES=$1 python -m sglang.launch_server --model-path "$MODEL" --port "$2" \
    --page-size 64 --enable-metrics \
    --enable-hierarchical-cache --hicache-ratio 2 --hicache-mem-layout page_first \
    --hicache-write-policy write_through --hicache-storage-prefetch-policy wait_complete \
    --hicache-storage-backend dynamic \
    --hicache-storage-backend-extra-config "@$CONFIG" &
}

launch 0 30000
launch 1 30001
wait
