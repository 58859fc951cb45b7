"""What the trainer is made of before its first step: the ``accelerate.Accelerator``, DeepSpeed's
config, the policy model (varlen attention, gradient checkpointing, frozen layers, LoRA), the
frozen reference for the KL term, and the autocast region a step runs in.

Invariants:
- Models load in fp32 (the master weights; a LoRA run's frozen base on a GPU in model.dtype);
  bf16 autocast is used only where the hardware has
  bf16 math, and DeepSpeed with bf16 keeps bf16 weights with fp32 masters in its partitions.
- DeepSpeed's config is adjusted before any model is built (ZeRO-3's zero3_init_flag makes
  ``from_pretrained`` load partitions only), and ``train.micro_batch`` and ``train.grad_clip``
  are its only micro-batching and clipping knobs.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import torch

from pipeline.config import TrainConfig
from pipeline.learner.logprobs import Policy
from pipeline.learner.lora import apply_lora

log = logging.getLogger(__name__)


def make_accelerator(cuda: bool) -> Any:
    """One process on CPU/GPU by default; under `accelerate launch` the launcher's env (and its
    --config_file: DDP, DeepSpeed ZeRO-2/3, offload) decides."""
    from accelerate import Accelerator

    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true" and not cuda:
        # DeepSpeed on CPU (DS_ACCELERATOR=cpu; tests): accelerate ignores DeepSpeed with
        # cpu=True and names a backend only for accelerators, so name gloo.
        from accelerate.utils import InitProcessGroupKwargs

        return Accelerator(cpu=False, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    return Accelerator(cpu=not cuda)


def configure_deepspeed(c: dict[str, Any], t: TrainConfig, world: int) -> int:
    """Our micro-batching, clipping and gathering in the DeepSpeed config ``c``; returns the
    ZeRO stage.

    The batch's micro-batches are ours (one accumulation boundary per batch), so DeepSpeed
    accumulates over exactly one "step"; ``train.grad_clip`` is the one clipping knob;
    ZeRO-3 must gather full weights for snapshots; CPU offload runs the client AdamW on the
    CPU partitions (DeepSpeedCPUAdam would need a compiled op).
    """
    for key, ours in (("gradient_accumulation_steps", 1), ("gradient_clipping", t.grad_clip)):
        theirs = c.get(key, "auto")
        if theirs not in ("auto", ours):
            log.warning("DeepSpeed config %s=%s replaced by %s (set by train.micro_batch / "
                        "train.grad_clip)", key, theirs, ours)
    c.update({"train_micro_batch_size_per_gpu": t.micro_batch,
              "gradient_accumulation_steps": 1,
              "train_batch_size": t.micro_batch * world,
              "gradient_clipping": t.grad_clip})
    zo = c.setdefault("zero_optimization", {})
    stage = int(zo.get("stage", 0))
    if stage == 3:
        zo["stage3_gather_16bit_weights_on_model_save"] = True
    if (zo.get("offload_optimizer") or {}).get("device", "none") not in ("none", None):
        c.setdefault("zero_force_ds_cpu_optimizer", False)
    return stage


def load_policy_model(model_path: str, t: TrainConfig, attn: dict[str, str],
                      lora_base: torch.dtype = torch.float32) -> tuple[Any, dict[str, float]]:
    """The trainable HF model in fp32 (``attn``: its attention implementation), with gradient
    checkpointing, frozen layers and LoRA as ``t`` asks, and its LoRA modules ({} without).
    Under LoRA the frozen base loads in ``lora_base`` (bf16 on a GPU: a 7B base is 15 GB, not
    30, beside its engine on one card); peft keeps the adapter itself in fp32."""
    from transformers import AutoModelForCausalLM

    dtype = lora_base if t.lora_rank > 0 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **attn)
    if t.gradient_checkpointing:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    if t.freeze_layers:
        freeze_layers(model, t.freeze_layers)
    lora: dict[str, float] = {}
    if t.lora_rank > 0:
        model, lora = apply_lora(model, t)
    model.train()
    return model, lora


def freeze_layers(model: Any, k: int) -> None:
    """The input embeddings and the first ``k`` decoder layers stop training."""
    layers = model.base_model.layers
    if k > len(layers):
        raise ValueError(f"train.freeze_layers={k} but the model has {len(layers)} layers")
    model.get_input_embeddings().requires_grad_(False)
    for layer in layers[:k]:
        layer.requires_grad_(False)


def reference_model(model_path: str, attn: dict[str, str], chunk: int, device: torch.device,
                    zero3_config: dict[str, Any] | None = None) -> Any:
    """The frozen reference for the KL term, behind the same token-logprob forward.

    ``zero3_config``: DeepSpeed's config under ZeRO-3, where the reference is as large as the
    policy, so it is partitioned like it (loaded partitioned under zero3_init_flag): an inference
    engine, no optimiser. Its forward gathers layer by layer, a collective that every rank runs
    (same micro-batch count)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, **attn)
    ref = Policy(ref, chunk).eval().requires_grad_(False)
    if zero3_config is None:
        return ref.to(device)
    import deepspeed

    conf = copy.deepcopy(zero3_config)
    for key in ("optimizer", "scheduler"):
        conf.pop(key, None)
    engine, *_ = deepspeed.initialize(model=ref, config=conf)
    engine.eval()
    return engine


def autocast(dtype: str, device: torch.device) -> Any:
    """bf16 autocast where the hardware has bf16 math (GPUs, AVX512-BF16/AMX CPUs: ~5x
    faster matmuls than fp32 on the 2-core dev machines); fp32 master weights either way.
    ``dtype``: ``model.dtype`` of the config."""
    if dtype != "bfloat16":
        return torch.autocast(device.type, enabled=False)
    if device.type == "cpu" and not torch.cpu._is_avx512_bf16_supported():
        return torch.autocast("cpu", enabled=False)
    return torch.autocast(device.type, dtype=torch.bfloat16)
