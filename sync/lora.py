"""LoRA adapter-only sync: which runs can use it, and peft's adapter format on disk.

With adapter sync a version's snapshot file carries only the LoRA tensors, under peft's saved
names (``<module>.lora_A.weight`` / ``<module>.lora_B.weight``, no adapter name), so the file is
a valid ``adapter_model.safetensors``. A producer turns a verified snapshot into one adapter
directory per version (``adapter_config.json`` + ``adapter_model.safetensors``, peft's layout)
that vLLM's LoRA support loads as a ``LoRARequest``. Invariants:
- whether a run's versions can travel as adapters is one pure function (``adapter_sync_plan``) of
  the run's options, decided once per run, so the learner and every producer agree on what a
  snapshot holds;
- an adapter directory is complete or absent (written under a temporary name and renamed);
- a snapshot whose names are not all LoRA A/B tensors is refused before vLLM sees it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sync.snapshot import SnapshotError, SnapshotRef, base_snapshot_files, read_snapshot

# Modules vLLM's LoRA layers serve for the decoder models this project trains (Llama, Qwen2,
# Mistral...): the attention and MLP projections. Embeddings and lm_head need extra vocab
# handling in vLLM and are left to the merged path.
VLLM_LORA_MODULES = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
)
# Embedding layers: peft keeps their LoRA as ``lora_embedding_A``/``lora_embedding_B``, not the
# ``lora_A``/``lora_B`` weights of a linear layer that an adapter file here carries.
EMBEDDING_MODULES = frozenset({"embed_tokens", "wte", "word_embeddings"})
# The ranks vLLM accepts for ``max_lora_rank`` (LoRAConfig's allowed values).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def adapter_sync_plan(mode: str, lora_rank: int, target_modules: list[str]) -> tuple[bool, str]:
    """(on, reason): whether versions travel as LoRA adapters; ``reason`` says why not (empty
    when on, or when nothing is asked: ``mode`` off or a full fine-tune). ``mode`` "auto" and
    "on" ask to serve the adapter through vLLM's LoRA support, so vLLM's limits apply (the
    modules it serves, its largest rank); whether "auto" asks at all (not on CPU) is decided
    before. With "merge" the producers merge each adapter into their engine's weights
    (``merge_adapter``) and vLLM's LoRA is not used: any linear module, any rank."""
    if mode == "off" or lora_rank <= 0:
        return False, ""
    embeddings = sorted(set(target_modules) & EMBEDDING_MODULES)
    if mode == "merge":
        if embeddings:
            return False, (
                f"train.lora_target_modules {', '.join(embeddings)}: an embedding's LoRA "
                f"tensors (peft's lora_embedding_A/B) are not carried by adapter files, which "
                f"hold linear layers' lora_A/lora_B"
            )
        return True, ""
    unsupported = sorted(set(target_modules) - VLLM_LORA_MODULES)
    if unsupported:
        served = ", ".join(sorted(VLLM_LORA_MODULES))
        return False, (
            f"vLLM's LoRA does not serve train.lora_target_modules "
            f"{', '.join(unsupported)} (it serves {served})"
        )
    if lora_rank > VLLM_LORA_RANKS[-1]:
        return False, (
            f"train.lora_rank {lora_rank} is above vLLM's largest max_lora_rank "
            f"{VLLM_LORA_RANKS[-1]}"
        )
    return True, ""


def vllm_max_lora_rank(lora_rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``lora_rank``."""
    for r in VLLM_LORA_RANKS:
        if r >= lora_rank:
            return r
    raise ValueError(f"LoRA rank {lora_rank} is above vLLM's largest max_lora_rank")


def adapter_config(
    lora_rank: int, lora_alpha: float, target_modules: list[str], base_model: str = ""
) -> dict[str, Any]:
    """peft's ``adapter_config.json`` for a plain LoRA adapter (the fields vLLM reads)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora_rank,
        "lora_alpha": lora_alpha,
        "target_modules": sorted(target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": base_model,
        "inference_mode": True,
    }


def adapter_tensors(
    state: dict[str, torch.Tensor], modules: list[str], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The default adapter's A/B tensors of a peft state dict, under peft's saved names.

    ``modules`` are the LoRA layers' state-dict prefixes (``base_model.model.<module>``)."""
    out: dict[str, torch.Tensor] = {}
    for prefix in modules:
        for part in ("lora_A", "lora_B"):
            t = state[f"{prefix}.{part}.default.weight"].detach()
            out[f"{prefix}.{part}.weight"] = t if dtype is None else t.to(dtype)
    return out


def check_adapter_names(names: list[str]) -> None:
    """Refuse a snapshot that is not an adapter (e.g. a merged-weights one)."""
    bad = [n for n in names if not n.endswith((".lora_A.weight", ".lora_B.weight"))]
    if bad or not names:
        raise SnapshotError(f"not a LoRA adapter snapshot: {bad[:3] or 'no tensors'}")


def write_adapter(
    tensors: dict[str, torch.Tensor], config: dict[str, Any], directory: str | Path
) -> Path:
    """Write ``directory`` in peft's adapter layout, atomically (renamed into place)."""
    final = Path(directory)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(
        {k: v.to("cpu").contiguous() for k, v in tensors.items()},
        str(tmp / WEIGHTS_NAME),
        metadata={"format": "pt"},
    )
    (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def stage_adapter(ref: SnapshotRef, config: dict[str, Any], directory: str | Path) -> Path:
    """Verify snapshot ``ref`` (checksum, names) and write it as an adapter directory."""
    tensors = read_snapshot(ref)
    check_adapter_names(sorted(tensors))
    return write_adapter(tensors, config, directory)


# ------------------------------------------------------------------ merged on the producer
def base_name(adapter_name: str) -> str:
    """peft's saved name of a module's A or B tensor -> its base weight's name in the model's
    files (``base_model.model.model.layers.0.mlp.up_proj.lora_A.weight`` ->
    ``model.layers.0.mlp.up_proj.weight``)."""
    module = adapter_name.removesuffix(".lora_A.weight").removesuffix(".lora_B.weight")
    return module.removeprefix("base_model.model.") + ".weight"


def merge_adapter(adapter: dict[str, torch.Tensor], base: Callable[[str], torch.Tensor],
                  scale: float, device: torch.device | str | None = None
                  ) -> dict[str, torch.Tensor]:
    """W0 + scale * B @ A for every module ``adapter`` names, under the base weights' names:
    the weights a learner merging the same adapter would ship (``merge_lora``), computed where
    they are served. ``base(name)`` gives W0; each merge runs in fp32 on ``device`` and is cast
    to W0's dtype at once. Refuses an adapter with a module missing its A or B, or whose B @ A
    does not have W0's shape, before anything is returned."""
    check_adapter_names(sorted(adapter))
    modules = sorted({n.rsplit(".lora_", 1)[0] for n in adapter})
    out: dict[str, torch.Tensor] = {}
    for m in modules:
        a, b = adapter.get(f"{m}.lora_A.weight"), adapter.get(f"{m}.lora_B.weight")
        if a is None or b is None:
            raise SnapshotError(f"LoRA module {m} lacks its {'A' if a is None else 'B'} tensor")
        name = base_name(f"{m}.lora_A.weight")
        w0 = base(name)
        delta = b.to(device, torch.float32) @ a.to(device, torch.float32)
        if tuple(delta.shape) != tuple(w0.shape):
            raise SnapshotError(f"LoRA module {m}: B @ A is {tuple(delta.shape)}, the model's "
                                f"{name} is {tuple(w0.shape)}")
        out[name] = (w0.to(device, torch.float32) + scale * delta).to(w0.dtype)
    return out


class BaseWeights:
    """The model's own tensors by name, read from its safetensors files on first use and kept in
    host memory: the W0 of the modules the adapters target, read once per engine."""

    def __init__(self, model_dir: str | Path):
        self.files = base_snapshot_files(model_dir)
        self._where: dict[str, str] | None = None
        self._held: dict[str, torch.Tensor] = {}

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self._held:
            if self._where is None:
                self._where = {}
                for f in self.files:
                    with safe_open(f, framework="pt") as fh:
                        self._where.update(dict.fromkeys(fh.keys(), f))
            if name not in self._where:
                raise SnapshotError(f"the adapter targets {name}, which is not in the model's "
                                    f"files")
            with safe_open(self._where[name], framework="pt") as fh:
                self._held[name] = fh.get_tensor(name)
        return self._held[name]

