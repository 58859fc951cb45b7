"""The learner's LoRA: the peft adapter put on the model (``train.lora_*``), which modules carry
it, peft's state-dict names as the base model's, and W + scale * B @ A merged under those names.

The merge is pure tensor maths on a state dict (peft is imported only to wrap the model and find
the LoRA layers), so the same merge serves a live trainer's snapshot and a saved checkpoint's
weights (``pipeline.launch.checkpoint_weights``). Adapter-only versions (the LoRA tensors alone)
are ``sync.lora``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pipeline.config import TrainConfig


def apply_lora(model: Any, t: TrainConfig) -> tuple[Any, dict[str, float]]:
    """``model`` wrapped by peft with the default LoRA adapter of ``t`` (rank, alpha, dropout,
    target modules; no bias), and its ``lora_modules``."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(
        r=t.lora_rank, lora_alpha=t.lora_alpha, lora_dropout=t.lora_dropout,
        target_modules=list(t.lora_target_modules), bias="none"))
    return model, lora_modules(model)


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
