"""Where the run's processes go on the GPUs: the environment that pins the learner and each
producer to theirs, and the refusal, before anything starts, of an explicit weight transport
that the pinned placement rules out.

Lists are as ``RunConfig`` holds them (``learner_gpus`` '0,1', ``producer_gpus`` ['1', '2,3']);
'' or [] means "inherit the launcher's GPUs": nothing is pinned and nothing is checked here.
"""

from __future__ import annotations

from pipeline.options import ConfigError


def producer_gpu_env(producer_gpus: list[str], index: int) -> dict[str, str]:
    """Environment pinning producer ``index`` to its GPUs ({} = inherit). Children apply it
    before building their config, whose validation counts the GPUs it sees."""
    if not producer_gpus:
        return {}
    return {"CUDA_VISIBLE_DEVICES": str(producer_gpus[index % len(producer_gpus)])}


def learner_gpu_env(learner_gpus: str) -> dict[str, str]:
    """Environment pinning the learner (every rank) to its GPUs ({} = inherit)."""
    return {"CUDA_VISIBLE_DEVICES": str(learner_gpus)} if learner_gpus else {}


def check_placement(transport: str, learner_gpus: str, producer_gpus: list[str]) -> None:
    """Refuse an explicit ``sync.transport`` the GPU placement rules out (e.g. 'nccl' with the
    learner on a producer's GPU), in one ConfigError, rather than a silent file fallback once
    the engines are up. Unknown placements are not checked: the learner still checks each
    producer at run time, from its GPU UUIDs."""
    from sync.routes.base import RouteChoiceError, choose_route

    if transport in ("auto", "file") or not learner_gpus or not producer_gpus:
        return
    learner = learner_gpus.split(",")[0]  # rank 0 sends the weights
    for i, gpus in enumerate(producer_gpus):
        try:
            choose_route(transport, f"GPU {learner}", [f"GPU {g}" for g in gpus.split(",")])
        except RouteChoiceError as e:
            raise ConfigError(f"sync.transport: producer_gpus[{i}]: {e}") from None
