"""Write a random-init Qwen2-0.5B- or 1.5B-shaped model (bf16) for GPU benchmarks, no hub.

    python -m bench.gpu_model OUT_DIR [--size 0.5b|1.5b]

The tokenizer is the tiny test model's byte-level one (260 tokens): the benchmarks feed token ids,
and vLLM accepts any id below the model's vocab_size (151936) and detokenizes unknown ids as "".
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

SIZES = {"0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                      num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                      tie_word_embeddings=True, max_position_embeddings=4096),
         "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                      num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                      tie_word_embeddings=True, max_position_embeddings=4096)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_model",
                                description=__doc__.split("\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--size", default="0.5b", choices=sorted(SIZES))
    args = p.parse_args(argv)
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipeline.models import TINY_VOCAB_SIZE, build_tiny_model

    config = Qwen2Config(**SIZES[args.size], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    assert config.vocab_size >= TINY_VOCAB_SIZE
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(args.out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(Path(tmp) / "tiny")
        for f in tiny.iterdir():
            if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
                shutil.copy2(f, args.out_dir / f.name)
    n = sum(t.numel() for t in model.parameters())
    print(f"[gpu_model] {args.size}: {n / 1e6:.0f}M params -> {args.out_dir}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
