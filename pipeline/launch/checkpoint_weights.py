"""The weights of any checkpoint ``pipeline-train`` writes, as the engine loads them.

Owns reading a checkpoint's model for ``pipeline-train eval``, whatever kind it is, told from the
checkpoint itself (never from the config):
- full weights: the trainer state (``trainer.json`` and its safetensors files; ``trainer.pt``
  in older checkpoints) holds the model's state dict under ``"model"``;
- LoRA: the same state dict under peft's names (``base_model.model.<module>.base_layer.weight``,
  ``...lora_A.default.weight``); each adapter is merged into its base weight (W + alpha/r · B @ A,
  as the learner merges a version; r from the tensors, alpha from ``train.lora_alpha``) and every
  name becomes the base model's;
- DeepSpeed ZeRO-2/3: the trainer state has ``deepspeed_zero_stage`` and no model; the weights are
  consolidated on the CPU from every rank's partitions in ``deepspeed/`` (DeepSpeed's
  ``zero_to_fp32``, the fp32 master weights), and may be LoRA too;
- FSDP2 (``train.fsdp2``): the trainer state has ``fsdp2_ranks`` and no model; the fp32 weights
  are read from every rank's shards in ``fsdp/`` (``pipeline.learner.fsdp.consolidate``).

Invariant: what comes out has exactly the model's tensors (the names and shapes of the model
directory's safetensors headers, as the engine checks them; a tied ``lm_head`` left out), in the
engine's dtype. Anything else (missing files, another model's weights, a partial state) is a
``CheckpointError`` of one line, raised before any engine starts.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any

from pipeline.learner.checkpoint import (
    DEEPSPEED_DIR,
    DEEPSPEED_TAG,
    CheckpointError,
    load_checkpoint,
)
from pipeline.learner.fsdp import FSDP_DIR
from pipeline.learner.lora import hf_name, merge_lora

PEFT_PREFIX = "base_model.model."
_LORA = re.compile(r"^(?P<prefix>.+)\.lora_(?P<part>[AB])\.default\.weight$")


def checkpoint_kind(tensors: dict[str, Any], ckpt: Path) -> str:
    """``"full"`` (the model in the trainer state) or ``"deepspeed"`` (partitions in
    ``deepspeed/``), from what the checkpoint holds; CheckpointError if neither is there."""
    if "model" in tensors:
        return "full"
    if "deepspeed_zero_stage" in tensors:
        if not (ckpt / DEEPSPEED_DIR / DEEPSPEED_TAG).is_dir():
            raise CheckpointError(f"checkpoint {ckpt} was written under DeepSpeed ZeRO-"
                                  f"{tensors['deepspeed_zero_stage']} but has no "
                                  f"{DEEPSPEED_DIR}/{DEEPSPEED_TAG}/ with its partitions")
        return "deepspeed"
    if "fsdp2_ranks" in tensors:
        if not (ckpt / FSDP_DIR / ".metadata").is_file():
            raise CheckpointError(f"checkpoint {ckpt} was written under FSDP2 but has no "
                                  f"{FSDP_DIR}/ with its shards")
        return "fsdp2"
    raise CheckpointError(f"checkpoint {ckpt}: its trainer state holds no model weights (no "
                          f"'model' and no 'deepspeed_zero_stage')")


def consolidate_deepspeed(ckpt: Path) -> dict[str, Any]:
    """The full fp32 state dict of a ZeRO-2/3 checkpoint, gathered on the CPU from every rank's
    partitions, under the learner module's names (the ``logprobs.Policy`` wrapper's ``model.``
    prefix removed)."""
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as e:
        raise CheckpointError(f"checkpoint {ckpt} was written under DeepSpeed; reading it needs "
                              f"deepspeed ({e})") from None
    # zero_to_fp32 reports each file it reads with print(); the command's output stays ours.
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt / DEEPSPEED_DIR),
                                                          tag=DEEPSPEED_TAG)
    except Exception as e:  # missing rank files, torn pickles, ...: one line either way
        msg = " ".join(str(e).split()) or type(e).__name__
        raise CheckpointError(
            f"checkpoint {ckpt}: DeepSpeed partitions unreadable: {msg}") from None
    return {k.removeprefix("model."): v for k, v in sd.items()}


def consolidate_fsdp2(ckpt: Path) -> dict[str, Any]:
    """The full fp32 state dict of an FSDP2 checkpoint, read from every rank's shards."""
    from pipeline.learner.fsdp import consolidate

    try:
        return consolidate(ckpt)
    except Exception as e:  # missing shard files, torn metadata, ...: one line either way
        msg = " ".join(str(e).split()) or type(e).__name__
        raise CheckpointError(f"checkpoint {ckpt}: FSDP2 shards unreadable: {msg}") from None


def lora_scales(state: dict[str, Any], alpha: float) -> dict[str, float]:
    """peft LoRA modules of a state dict: prefix -> alpha / r (r: rows of its lora_A)."""
    parts: dict[str, set[str]] = {}
    for name in state:
        if m := _LORA.match(name):
            parts.setdefault(m["prefix"], set()).add(m["part"])
    half = sorted(p for p, got in parts.items() if got != {"A", "B"} or
                  f"{p}.base_layer.weight" not in state)
    if half:
        raise CheckpointError(
            f"LoRA module {half[0]} lacks its lora_A, lora_B or base_layer weight")
    return {p: alpha / int(state[f"{p}.lora_A.default.weight"].shape[0]) for p in parts}


def engine_weights(state: dict[str, Any], lora_alpha: float, dtype: Any
                   ) -> tuple[dict[str, Any], dict[str, int]]:
    """The model's weights under the base model's names in ``dtype``, LoRA merged as the
    learner merges a version; returns (weights, {LoRA module: its rank})."""
    if not any(k.startswith(PEFT_PREFIX) for k in state):
        return {k: v.detach().to(dtype) for k, v in state.items()}, {}
    scales = lora_scales(state, lora_alpha)
    out = merge_lora(state, scales, dtype)
    lora_owned = {f"{p}.{part}" for p in scales
                  for part in ("base_layer.weight", "lora_A.default.weight",
                               "lora_B.default.weight")}
    for k, v in state.items():
        if k not in lora_owned:
            out.setdefault(hf_name(k), v.detach().to(dtype))
    return out, {p: int(state[f"{p}.lora_A.default.weight"].shape[0]) for p in scales}


def check_fits_model(weights: dict[str, Any], manifest: dict[str, tuple[int, ...]],
                     ckpt: Path, model: str) -> None:
    """Exactly the model's tensors with its shapes, else one line naming what differs."""
    unknown = sorted(set(weights) - set(manifest))
    missing = sorted(set(manifest) - set(weights))
    bad = sorted(k for k in set(weights) & set(manifest)
                 if tuple(weights[k].shape) != tuple(manifest[k]))
    problems = []
    if unknown:
        problems.append(f"{len(unknown)} tensor(s) not in the model, e.g. {unknown[:2]}")
    if bad:
        k = bad[0]
        problems.append(f"{len(bad)} with another shape, e.g. {k} "
                        f"{tuple(weights[k].shape)} (model {tuple(manifest[k])})")
    if missing:
        problems.append(f"{len(missing)} of the model's tensor(s) missing, e.g. {missing[:2]}")
    if problems:
        raise CheckpointError(f"checkpoint {ckpt} does not hold the weights of model.path {model}: "
                     + "; ".join(problems))


def _tied(model_path: str) -> bool:
    try:
        conf = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    tied = conf.get("tie_word_embeddings")
    if tied is None:  # multimodal/nested configs keep it in their text config
        tied = (conf.get("text_config") or {}).get("tie_word_embeddings", False)
    return bool(tied)


def checkpoint_weights(ckpt: Path, model_path: str, lora_alpha: float, dtype: Any
                       ) -> tuple[Any, dict[str, Any], str]:
    """(LearnerState, weights for the engine, a description of the kind) of checkpoint
    ``ckpt``; CheckpointError (one line) if it cannot be read or is another model's."""
    from sync.snapshot import SnapshotError, model_manifest

    try:
        manifest = model_manifest(model_path)
    except SnapshotError as e:
        raise CheckpointError(f"model.path: {e}") from None
    state, tensors, _buffer = load_checkpoint(ckpt)
    kind = checkpoint_kind(tensors, ckpt)
    if kind == "full":
        model_state = tensors["model"]
        what = "full weights"
    elif kind == "fsdp2":
        model_state = consolidate_fsdp2(ckpt)
        what = f"FSDP2 over {tensors['fsdp2_ranks']} ranks (consolidated)"
    else:
        model_state = consolidate_deepspeed(ckpt)
        what = f"DeepSpeed ZeRO-{tensors['deepspeed_zero_stage']} (consolidated)"
    del tensors
    if not isinstance(model_state, dict) or not model_state:
        raise CheckpointError(f"checkpoint {ckpt} holds an empty model state")
    weights, ranks = engine_weights(model_state, lora_alpha, dtype)
    del model_state
    if ranks:  # alpha is the config's (not in the checkpoint): shown, as a wrong one misleads
        r = "/".join(str(x) for x in sorted(set(ranks.values())))
        what += f", LoRA rank {r} alpha {lora_alpha:g} ({len(ranks)} modules merged)"
    if _tied(model_path):
        weights.pop("lm_head.weight", None)
        manifest.pop("lm_head.weight", None)
    check_fits_model(weights, manifest, ckpt, model_path)
    return state, weights, what
