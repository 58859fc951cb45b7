"""The ``launch`` section of the run configuration (``pipeline.config``): where the processes
run, this machine or a Ray cluster, and the Ray placement options. Declared like every section:
type, bounds ``opt(...)`` and the docstring under each field, which is its ``--help`` text."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pipeline.options import check, enforce, opt


def _check_resources(value: dict, option: str) -> None:
    check(all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
             for v in value.values()), option,
          f"must map resource names to positive amounts, e.g. {{learner_node: 1}}, got {value!r}")


def _check_labels(value: dict, option: str) -> None:
    check(all(isinstance(v, str) for v in value.values()), option,
          f"must map node label names to values (Ray label selector syntax, e.g. "
          f"{{ray.io/accelerator-type: H100}} or {{zone: !us-east-1a}}), got {value!r}")


@dataclass
class LaunchConfig:
    """Where the processes run. The same YAML runs under both launchers; only the ``ray``
    launcher reads the placement options."""

    backend: Literal["local", "ray"] = "local"
    """local: learner and producers as processes of this machine; ray: as Ray actors placed on a
    Ray cluster (pip install .[ray])"""
    ray_address: str = ""
    """ray: 'auto' (the cluster this node belongs to), HOST:PORT of a running cluster's head, or
    '' to start a private single-node Ray instance for this run"""
    ray_object_store_mb: int = opt(512, ge=64)
    """ray, private instance: object store size (MB)"""
    ray_timeout_s: float = opt(20.0, gt=0)
    """ray: max wait to connect to the cluster, and for the placement groups; then one error
    naming what is missing"""
    learner_num_cpus: float = opt(1.0, ge=0)
    """ray: CPUs reserved for the learner"""
    learner_num_gpus: float = opt(0.0, ge=0)
    """ray: GPUs reserved for the learner (all its ranks run on that one node)"""
    learner_resources: dict[str, Any] = opt({})
    """ray: custom resources of the learner's bundle, e.g. {trainer_node: 1}"""
    learner_labels: dict[str, Any] = opt({})
    """ray: node label selector for the learner"""
    producer_num_cpus: float = opt(1.0, ge=0)
    """ray: CPUs reserved for each producer"""
    producer_num_gpus: float = opt(0.0, ge=0)
    """ray: GPUs reserved for each producer (its engine's tensor_parallel_size on GPU clusters)"""
    producer_resources: dict[str, Any] = opt({})
    """ray: custom resources of each producer's bundle"""
    producer_labels: dict[str, Any] = opt({})
    """ray: node label selector for every producer"""
    producer_strategy: Literal["SPREAD", "STRICT_SPREAD", "PACK"] = "SPREAD"
    """ray: placement of the producers' bundles: SPREAD (over nodes, best effort), STRICT_SPREAD
    (one per node), PACK"""
    memory_check: bool = True
    """local: before anything starts, refuse (one line naming the options) a plan whose learner
    state + engine share cannot fit a GPU (pipeline.memory); false tries anyway"""
    stream_weights: Literal["auto", "always", "never"] = "auto"
    """ray: how producers get snapshot files: auto streams them to producers on another node than
    the learner (sync.stream_from), always streams to every producer, never reads the
    learner's snapshot_dir (set it to a shared path)"""
    shared_run_dir: bool = False
    """ray: run_dir is the same directory on every node (a network filesystem): actors write
    there directly instead of a node-local directory mirrored to the driver"""

    def __post_init__(self) -> None:
        enforce(self, "launch")
        addr = self.ray_address
        check(addr in ("", "auto") or re.fullmatch(r"(ray://)?[^:\s/]+:\d+", addr) is not None,
              "launch.ray_address", f"must be auto or HOST:PORT, got {addr!r}")
        for side in ("learner", "producer"):
            _check_resources(getattr(self, f"{side}_resources"), f"launch.{side}_resources")
            _check_labels(getattr(self, f"{side}_labels"), f"launch.{side}_labels")
