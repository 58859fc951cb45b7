"""Write a random-init Qwen2-shaped model (bf16) for GPU benchmarks, no hub.

    python -m bench.gpu_model OUT_DIR [--size 0.5b|1.5b|3b|7b]

Shapes: Qwen2-0.5B, Qwen2-1.5B, Qwen2.5-3B (tied embeddings) and Qwen2.5-7B (untied). The
weights are drawn where they are stored, in bf16 (on the GPU when there is one), one tensor at a
time, and written straight to safetensors shards: no fp32 model is built, so 7B is written in
seconds plus the disk write. Linear and embedding weights ~ N(0, 0.02) (the config's
initializer_range, as transformers' init), q/k/v biases 0, norms 1.

The tokenizer is the tiny test model's byte-level one (260 tokens): the benchmarks feed token ids,
and vLLM accepts any id below the model's vocab_size (151936) and detokenizes unknown ids as "".
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

SIZES = {"0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                      num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                      tie_word_embeddings=True, max_position_embeddings=4096),
         "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                      num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                      tie_word_embeddings=True, max_position_embeddings=4096),
         "3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
                    num_key_value_heads=2, intermediate_size=11008, vocab_size=151936,
                    tie_word_embeddings=True, max_position_embeddings=4096),
         "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                    num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                    tie_word_embeddings=False, max_position_embeddings=4096)}
SHARD_BYTES = 4 << 30  # bf16 bytes per safetensors shard


def tensor_specs(spec: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init) of every stored tensor of a Qwen2ForCausalLM with this shape, in
    transformers' names; init is "normal", "zeros" or "ones". A tied head is not stored."""
    h, inter = spec["hidden_size"], spec["intermediate_size"]
    head_dim = spec.get("head_dim") or h // spec["num_attention_heads"]
    q, kv = spec["num_attention_heads"] * head_dim, spec["num_key_value_heads"] * head_dim
    out = [("model.embed_tokens.weight", (spec["vocab_size"], h), "normal")]
    for i in range(spec["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,), "ones"),
                (p + "self_attn.q_proj.weight", (q, h), "normal"),
                (p + "self_attn.q_proj.bias", (q,), "zeros"),
                (p + "self_attn.k_proj.weight", (kv, h), "normal"),
                (p + "self_attn.k_proj.bias", (kv,), "zeros"),
                (p + "self_attn.v_proj.weight", (kv, h), "normal"),
                (p + "self_attn.v_proj.bias", (kv,), "zeros"),
                (p + "self_attn.o_proj.weight", (h, q), "normal"),
                (p + "post_attention_layernorm.weight", (h,), "ones"),
                (p + "mlp.gate_proj.weight", (inter, h), "normal"),
                (p + "mlp.up_proj.weight", (inter, h), "normal"),
                (p + "mlp.down_proj.weight", (h, inter), "normal")]
    out.append(("model.norm.weight", (h,), "ones"))
    if not spec["tie_word_embeddings"]:
        out.append(("lm_head.weight", (spec["vocab_size"], h), "normal"))
    return out


def num_params(spec: dict[str, Any]) -> int:
    n = 0
    for _, shape, _ in tensor_specs(spec):
        k = 1
        for d in shape:
            k *= d
        n += k
    return n


def plan_shards(specs: list[tuple[str, tuple[int, ...], str]], shard_bytes: int = SHARD_BYTES,
                itemsize: int = 2) -> list[list[str]]:
    """Tensor names per shard, in order, each shard at most ``shard_bytes`` (a larger tensor gets
    a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape, _ in specs:
        b = itemsize
        for d in shape:
            b *= d
        if shards[-1] and size + b > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += b
    return shards


def write_config(out_dir: Path, spec: dict[str, Any]) -> Any:
    """config.json and generation_config.json of a Qwen2 of shape ``spec`` (no weights: what
    a benchmark that draws its weights on the GPU needs, with ``copy_tokenizer``)."""
    from transformers import GenerationConfig, Qwen2Config

    out_dir.mkdir(parents=True, exist_ok=True)
    config = Qwen2Config(**spec, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config.architectures = ["Qwen2ForCausalLM"]
    config.dtype = "bfloat16"
    config.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(out_dir)
    return config


def write_model(out_dir: Path, spec: dict[str, Any], *, device: str | None = None,
                seed: int = 0, shard_bytes: int = SHARD_BYTES) -> int:
    """config.json, generation_config.json and the bf16 safetensors shards (+ index) of a
    random-init Qwen2 of shape ``spec`` into ``out_dir``; returns the parameter count."""
    import torch
    from safetensors.torch import save_file

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = write_config(out_dir, spec)
    specs = tensor_specs(spec)
    shapes = {name: (shape, init) for name, shape, init in specs}
    gen = torch.Generator(device=device).manual_seed(seed)
    std = config.initializer_range
    shards = plan_shards(specs, shard_bytes)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total = {}, 0
    for names, fname in zip(shards, files, strict=True):
        tensors = {}
        for name in names:
            shape, init = shapes[name]
            if init == "normal":
                t = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, std,
                                                                                   generator=gen)
            else:
                t = (torch.zeros if init == "zeros" else torch.ones)(shape, dtype=torch.bfloat16,
                                                                     device=device)
            tensors[name] = t
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(out_dir / fname),
                  metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return num_params(spec)


def copy_tokenizer(out_dir: Path) -> None:
    """The tiny test model's tokenizer files (pipeline.models.build_tiny_model) into out_dir."""
    from pipeline.models import TINY_VOCAB_SIZE, build_tiny_model

    assert min(s["vocab_size"] for s in SIZES.values()) >= TINY_VOCAB_SIZE
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(Path(tmp) / "tiny")
        for f in tiny.iterdir():
            if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
                shutil.copy2(f, out_dir / f.name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_model",
                                description=__doc__.split("\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--size", default="0.5b", choices=sorted(SIZES))
    p.add_argument("--device", default=None, help="where the weights are drawn (default: cuda "
                   "if available, else cpu)")
    args = p.parse_args(argv)
    import time

    t0 = time.perf_counter()
    n = write_model(args.out_dir, SIZES[args.size], device=args.device)
    copy_tokenizer(args.out_dir)
    print(f"[gpu_model] {args.size}: {n / 1e6:.0f}M params -> {args.out_dir} in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
