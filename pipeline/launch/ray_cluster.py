"""This process's connection to a Ray cluster: the Ray version check, connecting to
``launch.ray_address`` or starting a private node, and, for the local launcher, the replicas of
its ``executor: ray`` rewards. Shared by the Ray launcher, the local launcher and
``pipeline-train eval``, none of which needs the others for it."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from pipeline.config import RunConfig
from pipeline.options import ConfigError
from pipeline.owner import owner_tag
from pipeline.schedule import engine_count

MIN_RAY = (2, 49)  # label selectors on placement-group bundles
FORWARDED_PREFIXES = ("PIPELINE_", "VLLM_", "HF_", "TOKENIZERS_")  # environment the actors get


def forwarded_env() -> dict[str, str]:
    """This process's environment that Ray actors get (``FORWARDED_PREFIXES``): the run's own
    settings and vLLM's, Hugging Face's and the tokenizers' (offline mode, cache sizes)."""
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES)}


def import_ray() -> Any:
    """The ray module, or a ConfigError saying how to install a recent enough Ray."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "launch.backend: 'ray' needs Ray: pip install 'pipeline-grpo[ray]' (or ray[default])"
        ) from None
    got = tuple(int(x) for x in ray.__version__.split(".")[:2] if x.isdigit())
    if got < MIN_RAY:
        raise ConfigError(
            f"launch.backend: Ray {ray.__version__} is too old; need "
            f">= {'.'.join(map(str, MIN_RAY))} (pip install 'pipeline-grpo[ray]')"
        )
    return ray


def _probe(address: str, timeout_s: float) -> str:
    """'' when something listens at the head's address, else why not (fails in seconds where
    ray.init would retry for minutes)."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=min(timeout_s, 10.0)):
            return ""
    except OSError as e:
        return f"nothing answers there ({e.strerror or e})"


def start_private_node(cfg: RunConfig) -> Any:
    """With no ``launch.ray_address``: start this run's own Ray node (a ``RayNode``, not yet
    ready: the caller checks the config meanwhile and ``connect`` waits for it); else None."""
    from pipeline.launch.ray_node import RayNode

    lc = cfg.launch
    if lc.ray_address:
        return None
    # Every producer bundle: the producers' and the dedicated evaluator's (eval.producer).
    engines = engine_count(cfg.producer_slots, cfg.eval.every, cfg.eval.producer)
    need = lc.learner_num_cpus + engines * lc.producer_num_cpus
    # 127.0.0.2: Ray rewrites 127.0.0.1 to the machine's network address; any other
    # loopback address stays as given, so a private run's traffic stays on loopback.
    return RayNode(
        "127.0.0.2",
        num_cpus=max(os.cpu_count() or 1, int(need + 0.999)),
        resources={
            **lc.learner_resources,
            **{k: v * engines for k, v in lc.producer_resources.items()},
        },
        object_store_mb=lc.ray_object_store_mb,
        owner=owner_tag(),  # a guard stops the node if this driver dies without stopping it
    )


def connect(ray: Any, cfg: RunConfig, node: Any = None) -> Any:
    """Connect to ``launch.ray_address``, or to the private node (``node``, started by
    ``start_private_node`` here when not given); a cluster that does not answer within
    ``launch.ray_timeout_s`` is a ConfigError, never a hang. Returns the private node."""
    lc = cfg.launch
    address = lc.ray_address
    if not address:
        node = node if node is not None else start_private_node(cfg)
        try:
            node.wait_ready(max(lc.ray_timeout_s, 120.0))
        except (RuntimeError, TimeoutError):
            node.stop()
            raise
        address = node.address
    kw: dict[str, Any] = {"log_to_driver": True, "configure_logging": False}
    host = address.removeprefix("ray://").rsplit(":", 1)[0]
    if host.startswith("127."):  # a loopback cluster: this machine's node is on that address
        kw["_node_ip_address"] = host
    why = _probe(address, lc.ray_timeout_s) if address != "auto" else ""
    if not why:
        try:
            ray.init(address=address, **kw)
        except (ConnectionError, RuntimeError, ValueError) as e:
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
    if why:
        if node is not None:
            node.stop()
        raise ConfigError(
            f"launch.ray_address: cannot connect to a Ray cluster at {address!r}: {why}"
        )
    return node


class RewardCluster:
    """The local launcher's use of Ray: only the replicas of its ``executor: ray`` rewards run on
    the cluster at ``launch.ray_address`` (this machine must be one of its nodes); the learner
    and producers stay local processes, which find the replicas through the environment they
    inherit (``pipeline.producer.rewards.ray_replicas``)."""

    def __init__(self, cfg: RunConfig) -> None:
        from pipeline.producer.rewards.ray_replicas import start_replicas

        self.ray = import_ray()
        connect(self.ray, cfg)
        try:
            env = {"env_vars": forwarded_env()}
            _handle, self.actors = start_replicas(
                self.ray, cfg.rewards.specs, timeout_s=cfg.launch.ray_timeout_s, runtime_env=env
            )
        except BaseException:
            self.ray.shutdown()
            raise

    def stop(self) -> None:
        from pipeline.producer.rewards.ray_replicas import stop_replicas

        stop_replicas(self.ray, self.actors)
        with contextlib.suppress(Exception):
            self.ray.shutdown()
