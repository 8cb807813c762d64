"""Build a small random-weight Llama model folder (config, safetensors, tokenizer) with no download.

Engines need a model folder; none can be fetched on a closed machine. The weights are drawn from one
seed (std 0.08: the default init makes greedy decoding repeat one token), so two builds are identical.
Presets: `tiny` (2 layers, hidden 256, GQA 4/2 heads of 64) for end-to-end checks, `bench` (wide and
deep enough that prefilling a 2048-token prompt costs seconds on a 2-core CPU) for TTFT figures.

    python -m kvpool.backends.engines.tiny_model OUT_DIR [--preset tiny|bench] [--seed 0]

Run it with an engine environment's python (it needs torch, transformers and tokenizers).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, intermediate_size=512),
    "bench": dict(num_hidden_layers=6, hidden_size=768, num_attention_heads=12, num_key_value_heads=4,
                  head_dim=64, intermediate_size=2048),
}
VOCAB = 512
MAX_POSITIONS = 4096


def _corpus(n: int = 4000) -> list[str]:
    import random
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) for _ in range(300)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) + "." for _ in range(n)]


def _tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(str(out))


def build(out: Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write the model folder to `out` (created) and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    _tokenizer(out)
    cfg = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-5,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                      torch_dtype="bfloat16", **PRESETS[preset])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    meta: dict[str, Any] = {"preset": preset, "seed": seed, "preset_config": PRESETS[preset]}
    (out / "kvpool_model.json").write_text(json.dumps(meta))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpool.backends.engines.tiny_model",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(build(args.out, args.preset, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
