"""Where the Ray launcher's roles go: each role's bundle of resources, its placement group
(reserved before any actor starts, so a run that cannot be placed fails in ``launch.ray_timeout_s``
with one line saying what the cluster lacks, never a hang)."""

from __future__ import annotations

from typing import Any

from pipeline.options import ConfigError


def bundle(cpus: float, gpus: float, resources: dict[str, float]) -> dict[str, float]:
    """One role's placement-group bundle: its CPUs, GPUs and custom resources, zeros left out."""
    b = {"CPU": float(cpus), "GPU": float(gpus)} | {k: float(v) for k, v in resources.items()}
    return {k: v for k, v in b.items() if v > 0}


def why_unplaced(ray: Any, bundle: dict[str, float], labels: dict[str, str]) -> str:
    """Why no node fits ``bundle``: what the cluster lacks, in one phrase."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    total = ray.cluster_resources()
    for name, amount in bundle.items():
        if total.get(name, 0) < amount:
            have = total.get(name, 0)
            return (
                f"the cluster has {have:g} {name} in all"
                if have
                else f"no node has resource {name!r}"
            ) + f" (needs {amount:g})"
    fits = [n for n in nodes if all(n["Resources"].get(k, 0) >= v for k, v in bundle.items())]
    if not fits:
        return f"no single node has all of {bundle}"
    if labels:
        return f"no node with {bundle} matches the labels {labels}"
    return f"the nodes with {bundle} are busy (resources held by other jobs)"


def place(
    ray: Any,
    name: str,
    bundles: list[dict[str, float]],
    strategy: str,
    labels: dict[str, str],
    timeout_s: float,
) -> Any:
    """The placement group of ``bundles`` once Ray has reserved it; a ConfigError saying what
    the cluster lacks when it is not ready within ``timeout_s``."""
    from ray.util.placement_group import placement_group, remove_placement_group

    if not all(bundles):
        raise ConfigError(
            f"launch: the {name}'s bundle reserves nothing (set "
            f"launch.{name}_num_cpus > 0 or a resource)"
        )
    selector = [dict(labels) for _ in bundles] if labels else None
    pg = placement_group(bundles, strategy=strategy, bundle_label_selector=selector)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        why = why_unplaced(ray, bundles[0], labels)
        if strategy == "STRICT_SPREAD" and len(bundles) > 1:
            why += f"; STRICT_SPREAD needs {len(bundles)} nodes that fit it"
        raise ConfigError(
            f"launch: cannot place the {name} within {timeout_s:.0f}s: {why} "
            f"(launch.{name}_num_cpus/_num_gpus/_resources/_labels)"
        ) from None
    return pg
