"""FSDP2 for the learner (``train.fsdp2``): the policy (and a KL reference) sharded with
``torch.distributed.fsdp.fully_shard``, its full weights gathered for snapshots, every rank's
shards saved and restored with ``torch.distributed.checkpoint``, and those shards read back as
one full state dict in one process (``consolidate``, for ``pipeline-train eval``).

Invariants:
- One FSDP group per decoder layer, and the ``Policy`` wrapper as the root: the root's own
  parameters (embeddings, final norm, output head) are gathered by the root's forward, which is
  the one the trainer calls, so the chunked output head (``pipeline.learner.logprobs``) runs on
  full weights in the forward and in its recomputation.
- Sharded parameters stay fp32 (the master weights the optimiser updates); with
  ``model.dtype`` bfloat16 they are gathered and computed in bf16 and gradients are
  reduce-scattered in fp32 (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``,
  what TRL's async trainer and verl use): 16 bytes a parameter over the ranks.
- Every function here is a collective: every rank calls it, in the same order.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

FSDP_DIR = "fsdp"  # inside a checkpoint dir: torch.distributed.checkpoint files of every rank


def shard(policy: torch.nn.Module, model: torch.nn.Module, device: torch.device,
          bf16: bool, reshard_root: bool = False) -> torch.nn.Module:
    """Shard ``policy`` (the module whose forward the trainer calls, wrapping ``model``) over
    every rank of the default process group, in place; returns it. ``reshard_root``: free the
    root's gathered weights after each forward too (a frozen reference, which has no backward)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                              reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(policy, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_root)
    return policy


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of an HF causal LM (Llama, Qwen2, Mistral shapes)."""
    layers = getattr(model.base_model, "layers", None)
    if layers is None:
        raise ValueError(f"train.fsdp2: no decoder layers found on {type(model).__name__}")
    return list(layers)


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded parameter (an all-gather), or ``p`` itself."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def full_state(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on rank 0's CPU, {} on the others."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))


def save(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Every rank writes its shards of the weights and of the AdamW state under
    ``directory``/fsdp."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(policy, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(Path(directory) / FSDP_DIR))


def load(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Every rank reads its shards back from ``directory``/fsdp (the same rank count)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(policy, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(Path(directory) / FSDP_DIR))
    set_state_dict(policy, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def consolidate(directory: Path) -> dict[str, torch.Tensor]:
    """The full fp32 weights in ``directory``/fsdp, read in this one process (no process
    group), under the HF model's names."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(Path(directory) / FSDP_DIR))
    meta = reader.read_metadata().state_dict_metadata
    # Saved as {"model": the Policy's state dict}: "model." + the Policy's "model." + HF name.
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
          if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, storage_reader=reader, no_dist=True)
    return {k.removeprefix("model.").removeprefix("model."): v for k, v in sd.items()}
