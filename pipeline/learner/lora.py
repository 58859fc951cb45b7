"""The learner's LoRA weights as full weights: which modules of a peft model carry LoRA, peft's
state-dict names as the base model's, and W + scale * B @ A merged under those names.

Pure tensor maths on a state dict (peft is imported only to find the LoRA layers), so the same
merge serves a live trainer's snapshot and a saved checkpoint's weights
(``pipeline.launch.checkpoint_weights``). Adapter-only versions (the LoRA tensors alone) are
``sync.lora``.
"""

from __future__ import annotations

from typing import Any

import torch


def lora_modules(model: Any) -> dict[str, float]:
    """peft LoRA layers of ``model``: state-dict prefix -> scaling of the default adapter."""
    from peft.tuners.lora import LoraLayer

    return {name: float(m.scaling["default"]) for name, m in model.named_modules()
            if isinstance(m, LoraLayer) and "default" in m.scaling}


def hf_name(peft_name: str) -> str:
    """peft state-dict name -> the base model's name (as in its safetensors files)."""
    name = peft_name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def merge_lora(state: dict[str, torch.Tensor], modules: dict[str, float],
               dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """W + scale * B @ A for each LoRA module of a peft state dict, under the base model's name.

    Computed from a (gathered) state dict, not from the live modules, so it works for ZeRO-3
    partitioned parameters too; only the LoRA-targeted weights are returned (nothing else
    changes under LoRA). Each merge is done in fp32 and cast to ``dtype`` at once, so the fp32
    copies never all exist together (about twice the model, on the learner's GPU)."""
    out = {}
    for prefix, scale in modules.items():
        w = state[f"{prefix}.base_layer.weight"].float()
        a = state[f"{prefix}.lora_A.default.weight"].float()
        b = state[f"{prefix}.lora_B.default.weight"].float()
        merged = w + scale * (b @ a)
        out[hf_name(f"{prefix}.weight")] = merged if dtype is None else merged.to(dtype)
    return out
