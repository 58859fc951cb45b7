"""Where the run's processes go on the GPUs, and what the launcher's machine has: the
environment that pins the learner and each producer to theirs, the GPUs this process sees, and
the refusal, before anything starts, of an explicit weight route that this machine or the
pinned placement rules out. These checks run once, in the launcher: a child pinned to its GPUs
(CUDA_VISIBLE_DEVICES) sees only those, which says nothing about the placement.

Lists are as ``RunConfig`` holds them (``learner_gpus`` '0,1', ``producer_gpus`` ['1', '2,3']);
'' or [] means "inherit the launcher's GPUs": nothing is pinned and nothing is checked here.
"""

from __future__ import annotations

from pipeline.options import ConfigError


def producer_gpu_env(producer_gpus: list[str], index: int) -> dict[str, str]:
    """Environment pinning producer ``index`` to its GPUs ({} = inherit). A child applies it
    first, before anything may initialise CUDA."""
    if not producer_gpus:
        return {}
    return {"CUDA_VISIBLE_DEVICES": str(producer_gpus[index % len(producer_gpus)])}


def learner_gpu_env(learner_gpus: str) -> dict[str, str]:
    """Environment pinning the learner (every rank) to its GPUs ({} = inherit)."""
    return {"CUDA_VISIBLE_DEVICES": str(learner_gpus)} if learner_gpus else {}


def cuda_device_count() -> int:
    """GPUs this process sees (torch imported only when a decision needs the count).
    ``torch.cuda.device_count`` asks NVML, never ``torch.cuda.is_available()``: that
    initialises CUDA, after which a child can no longer be pinned to its GPUs with
    CUDA_VISIBLE_DEVICES, and vLLM may fork after cuInit."""
    import torch

    return torch.cuda.device_count()


def check_placement(route: str, learner_gpus: str, producer_gpus: list[str]) -> None:
    """Refuse an explicit ``sync.route`` that this machine (no GPU at all) or the GPU
    placement rules out (e.g. 'nccl' with the learner on a producer's GPU), in one ConfigError,
    rather than a silent file fallback once the engines are up. Unknown placements are not
    checked: the learner still checks each producer at run time, from its GPU UUIDs."""
    from sync.routes.base import RouteChoiceError, choose_route

    if route in ("ipc", "nccl") and cuda_device_count() == 0:
        raise ConfigError(f"sync.route: {route!r} needs NVIDIA GPUs and none is visible "
                          f"(CPU build?); use 'file' or 'auto'")
    if route in ("auto", "file") or not learner_gpus or not producer_gpus:
        return
    learner = learner_gpus.split(",")[0]  # rank 0 sends the weights
    for i, gpus in enumerate(producer_gpus):
        try:
            choose_route(route, f"GPU {learner}", [f"GPU {g}" for g in gpus.split(",")])
        except RouteChoiceError as e:
            raise ConfigError(f"sync.route: producer_gpus[{i}]: {e}") from None
