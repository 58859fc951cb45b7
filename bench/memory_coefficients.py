"""The per-token activation coefficients of the memory plan (``pipeline.memory_plan``), measured.

    python -m bench.memory_coefficients

Builds small random Qwen2 models (transformers' own layers, sdpa attention) on the CPU, runs a
forward under bf16 autocast as the trainer does, and counts the bytes of every tensor autograd
saves for the backward (``torch.autograd.graph.saved_tensors_hooks``, each storage once). The
per-layer bytes at three sequence lengths separate a per-layer constant (autocast's bf16 weight
copies) from the per-token part; three shapes separate the hidden, intermediate and KV terms:
bytes per token per layer = H * hidden + I * intermediate + K * kv_dim. Rows: a full fine-tune
(fp32 weights) and LoRA on a bf16 base, each without and with gradient checkpointing (then only
a layer's input is kept, per token). What the saved tensors leave out (the backward's own
working memory, the allocator) the plan takes from the GPU runs (``bash bench/run_gpu.sh
one-card``)."""

from __future__ import annotations

import argparse

import numpy as np
import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPES = ((512, 1024), (512, 3072), (1024, 1024))  # (hidden, intermediate); KV dim 128
LENGTHS = (128, 256, 512)


def saved_bytes(hidden: int, inter: int, layers: int, tokens: int, checkpointing: bool,
                lora: bool) -> int:
    """Bytes autograd keeps for the backward of one forward of ``tokens`` tokens."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=2, vocab_size=1024,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16 if lora else torch.float32)
    if checkpointing:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, target_modules=TARGETS))
    model.train()
    seen: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 1000, (1, tokens))
    base = model.get_base_model() if lora else model
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        base.model(input_ids=ids, use_cache=False)
    return sum(seen.values())


def per_token_per_layer(hidden: int, inter: int, checkpointing: bool, lora: bool) -> float:
    """The per-token slope of one layer's saved bytes (2 vs 4 layers, fitted over LENGTHS)."""
    per_layer = [(saved_bytes(hidden, inter, 4, t, checkpointing, lora)
                  - saved_bytes(hidden, inter, 2, t, checkpointing, lora)) / 2 for t in LENGTHS]
    a = np.array([[1.0, t, t * t] for t in LENGTHS])
    _, slope, _ = np.linalg.solve(a, np.array(per_layer))
    return float(slope)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    print("| weights | checkpointing | H (x hidden) | I (x intermediate) | K (x kv_dim) |")
    print("|---|---|---|---|---|")
    for lora in (False, True):
        for ckpt in (False, True):
            y = [per_token_per_layer(h, i, ckpt, lora) for h, i in SHAPES]
            # y = H*h + I*i + K*128 over the three shapes
            a = np.array([[h, i, 128.0] for h, i in SHAPES])
            hh, ii, kk = np.linalg.solve(a, np.array(y))
            print(f"| {'LoRA, bf16 base' if lora else 'full, fp32'} | {'on' if ckpt else 'off'}"
                  f" | {hh:.1f} | {ii:.1f} | {kk:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
