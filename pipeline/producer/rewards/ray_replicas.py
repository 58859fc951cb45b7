"""Rewards with ``executor: ray``: a reward (typically a class holding a learned reward model) run
as Ray actors, its replicas, that every producer of the run shares.

Who does what:
- the run's driver (``pipeline.launch.ray``, or the local launcher given ``--ray-address``) calls
  ``start_replicas`` once, before any producer starts: ``num_replicas`` named actors per ray
  reward, in a namespace of this run only (``pipeline-<run id>``), each reserving the spec's
  ``num_cpus``/``num_gpus`` and restarted by Ray up to ``max_restarts`` times. The driver owns
  them, so they die with the run; ``stop_replicas`` kills them at the end. Where to find them
  reaches the producers in the environment variable ``PIPELINE_RAY_REWARDS`` (JSON: cluster
  address, namespace, replica names per reward);
- each producer's ``RewardSet`` (``pipeline.producer.rewards.runner``) holds one
  ``RayRewardClient`` per ray reward. It connects to the cluster on first use (after the engine
  is built: vLLM picks Ray as its executor for tensor parallelism when Ray is already
  initialised), looks the replicas up by name and sends each call to the next replica in turn.
  A call is a batch: a group's G completions go in one remote call whatever the reward's calling
  convention (``batch_items`` / ``split_results``);
- a replica calls the reward with ``call_blocking`` (``pipeline.producer.rewards.call``), as a
  thread or a process worker does; timeouts, ``max_concurrency``, ``rate_per_s`` and
  ``rewards.on_failure`` apply per remote call exactly as for the other executors
  (``call_reward``). A replica that dies mid-call (kill -9, OOM) is restarted by Ray; the call
  is retried once on the next replica (counted in ``reward/<name>/retries``); a second failure
  counts as a failure like any other, and the call's timeout bounds the whole attempt, so
  nothing waits forever.

``ray`` is imported only here and only when a spec uses ``executor: ray``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pipeline.config import RewardSpec
from pipeline.options import ConfigError
from pipeline.producer.rewards.call import call_blocking
from pipeline.producer.rewards.loading import CallMode, Scorer, build_scorer, describe

log = logging.getLogger(__name__)

HANDLE_ENV = "PIPELINE_RAY_REWARDS"
"""Environment variable carrying the run's replica handle (JSON) from the driver to producers."""
NODE_IP_ENV = "PIPELINE_RAY_NODE_IP"
"""This node's address as the cluster knows it, set by the Ray launcher's producer actor (a
machine with several raylets, as in loopback test clusters, cannot tell on its own)."""

DEFAULT_REPLICAS = 1
DEFAULT_CPUS = 1.0
DEFAULT_GPUS = 0.0
DEFAULT_RESTARTS = 3


@dataclass(frozen=True)
class ReplicaOptions:
    """The effective Ray options of one ray reward (the spec's, defaults filled in)."""

    num_replicas: int
    num_cpus: float
    num_gpus: float
    max_restarts: int


def replica_options(spec: RewardSpec) -> ReplicaOptions:
    """Defaults for the spec's unset Ray options (validated in ``RewardSpec``)."""
    return ReplicaOptions(
        num_replicas=spec.num_replicas if spec.num_replicas is not None else DEFAULT_REPLICAS,
        num_cpus=spec.num_cpus if spec.num_cpus is not None else DEFAULT_CPUS,
        num_gpus=spec.num_gpus if spec.num_gpus is not None else DEFAULT_GPUS,
        max_restarts=spec.max_restarts if spec.max_restarts is not None else DEFAULT_RESTARTS,
    )


def replica_names(reward: str, n: int) -> list[str]:
    """Actor names of a reward's replicas (unique within the run's namespace)."""
    return [f"reward-{reward}-{k}" for k in range(n)]


# ------------------------------------------------------------------ batching (pure logic)


def batch_items(
    prompt: Any, completions: list[str], metas: list[dict[str, Any]]
) -> list[tuple[Any, str, dict[str, Any]]]:
    """A per-completion reward's calls for one group, as the one batch sent to a replica."""
    return [(prompt, c, m) for c, m in zip(completions, metas, strict=True)]


def split_results(raw: Any, n: int) -> list[tuple[Any, str | None]]:
    """A replica's answer to ``score_each`` as (value, error) per completion; a malformed answer
    (wrong shape or length) is an error for every completion."""
    if not isinstance(raw, list | tuple) or len(raw) != n:
        got = len(raw) if isinstance(raw, list | tuple) else type(raw).__name__
        return [(None, f"replica answered {got} for {n} completions")] * n
    out: list[tuple[Any, str | None]] = []
    for item in raw:
        if not isinstance(item, list | tuple) or len(item) != 2:
            out.append((None, f"malformed replica answer {item!r:.80}"))
        else:
            value, err = item
            out.append((value, None if err is None else str(err)))
    return out


class RoundRobin:
    """Which replica takes the next call: each in turn (replicas are equal; a retry goes to
    the next one, which is alive unless every replica died at once)."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"need at least one replica, got {n}")
        self.n = n
        self._next = 0

    def take(self) -> int:
        i = self._next
        self._next = (i + 1) % self.n
        return i


# ------------------------------------------------------------------------------ replica side


class RewardReplica:
    """One replica: the user's reward built once (loading a model there is the point), then
    called with whole batches. Runs as a Ray actor; plain Python otherwise.

    The driver builds the first incarnation with ``load`` after Ray has placed it, so a replica
    that cannot be placed is told apart from a slow model load; a replica that Ray restarts
    builds its reward in ``__init__``, before it takes calls."""

    def __init__(
        self, name: str, index: int, fn: Any, kwargs: dict[str, Any], mode: CallMode
    ) -> None:
        self.name, self.index, self.mode = name, index, mode
        self.fn, self.kwargs = fn, dict(kwargs)
        self.scorer: Scorer | None = None
        self.restarted = False
        with contextlib.suppress(Exception):
            import ray

            if ray.is_initialized() and ray.get_runtime_context().get_actor_id():
                with warnings.catch_warnings():  # Ray's own property trips its deprecation
                    warnings.simplefilter("ignore", DeprecationWarning)
                    self.restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        if self.restarted:
            log.warning("reward %s replica %d restarted by Ray (pid %d)", name, index, os.getpid())
            self.load()

    def load(self) -> dict[str, Any]:
        """Build the reward (once); this replica's pid."""
        self._built()
        return self.info()

    def _built(self) -> Scorer:
        if self.scorer is None:
            self.scorer = build_scorer(self.fn, self.kwargs, self.mode)
        return self.scorer

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "restarted": self.restarted, "loaded": self.scorer is not None}

    def score(self, args: tuple[Any, ...]) -> Any:
        """A batched or TRL-style reward: one call for the group, its raw result."""
        return _to_plain(call_blocking(self._built(), tuple(args)))

    def score_each(self, items: list[tuple[Any, str, dict[str, Any]]]) -> list[tuple[Any, Any]]:
        """A per-completion reward over a batch: (value, None) or (None, error) per item, so
        one completion's exception does not fail its siblings."""
        single = replace(self._built(), mode="single")
        out: list[tuple[Any, Any]] = []
        for item in items:
            try:
                out.append((_to_plain(call_blocking(single, tuple(item))), None))
            except Exception as e:
                out.append((None, repr(e)))
        return out


def _to_plain(value: Any) -> Any:
    """Numbers as Python floats (a torch/numpy scalar or array would otherwise travel as one)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, list | tuple):
        return [v.item() if hasattr(v, "item") else v for v in value]
    return value.item() if hasattr(value, "item") else value


# ------------------------------------------------------------------------------- driver side


def ray_specs(specs: list[RewardSpec]) -> list[tuple[int, RewardSpec]]:
    """The ``executor: ray`` specs with their index in ``rewards.specs``."""
    return [(i, s) for i, s in enumerate(specs) if s.executor == "ray"]


def start_replicas(
    ray: Any,
    specs: list[RewardSpec],
    *,
    timeout_s: float,
    load_timeout_s: float = 600.0,
    runtime_env: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], list[Any]]:
    """Start every ray reward's replicas on the connected cluster and wait until each has built
    its reward (placed within ``timeout_s``, then the reward's own setup within
    ``load_timeout_s``). Returns the handle for the producers (also exported in ``HANDLE_ENV``)
    and the actors (for ``stop_replicas``). A replica that cannot be placed or built is a
    ConfigError naming the spec."""
    namespace = f"pipeline-{uuid.uuid4().hex[:12]}"
    handle: dict[str, Any] = {
        "address": ray.get_runtime_context().gcs_address,
        "namespace": namespace,
        "rewards": {},
    }
    actors: list[Any] = []
    pending: list[tuple[int, str, Any]] = []
    cls = ray.remote(RewardReplica)
    try:
        for i, spec in ray_specs(specs):
            info = describe(spec)
            o = replica_options(spec)
            names = replica_names(info.name, o.num_replicas)
            handle["rewards"][info.name] = names
            for k, actor_name in enumerate(names):
                actor = cls.options(
                    name=actor_name,
                    namespace=namespace,
                    num_cpus=o.num_cpus,
                    num_gpus=o.num_gpus,
                    max_restarts=o.max_restarts,
                    max_task_retries=0,  # a call on a dead replica is retried by the caller
                    runtime_env=runtime_env or {},
                ).remote(info.name, k, spec.fn, dict(spec.kwargs), info.mode)
                actors.append(actor)
                pending.append((i, info.name, actor))
        for i, name, actor in pending:
            _wait_ready(ray, i, name, specs[i], actor, timeout_s, load_timeout_s)
    except BaseException:
        stop_replicas(ray, actors)
        raise
    os.environ[HANDLE_ENV] = json.dumps(handle)
    log.info(
        "ray: reward actors up: %s",
        ", ".join(f"{n} x{len(v)}" for n, v in handle["rewards"].items()),
    )
    return handle, actors


def _wait_ready(
    ray: Any,
    i: int,
    name: str,
    spec: RewardSpec,
    actor: Any,
    timeout_s: float,
    load_timeout_s: float,
) -> None:
    """Until one replica is placed and has built its reward; a ConfigError naming the spec when
    it cannot be placed, fails to build, or builds for longer than ``load_timeout_s``."""
    o = replica_options(spec)
    where = f"rewards.specs[{i}]: reward {name!r}"
    try:
        ray.get(actor.info.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ConfigError(
            f"{where}: cannot place its replicas ({o.num_replicas} x {{CPU: {o.num_cpus:g}, "
            f"GPU: {o.num_gpus:g}}}) within {timeout_s:.0f}s: the cluster has {_free(ray)} free "
            f"(rewards.specs[{i}].num_cpus/num_gpus/num_replicas)"
        ) from None
    except ray.exceptions.RayActorError as e:
        raise ConfigError(f"{where}: its replica failed to start: {_first_line(e)}") from None
    try:
        ray.get(actor.load.remote(), timeout=load_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ConfigError(
            f"{where}: its replica did not finish building the reward within {load_timeout_s:.0f}s"
        ) from None
    except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
        raise ConfigError(f"{where}: building it on its replica failed: {_first_line(e)}") from None


def stop_replicas(ray: Any, actors: list[Any]) -> None:
    """Kill the replicas for good (no restart) and forget where they were."""
    os.environ.pop(HANDLE_ENV, None)
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)


def _free(ray: Any) -> str:
    free = ray.available_resources()
    return f"CPU {free.get('CPU', 0):g}, GPU {free.get('GPU', 0):g}"


def _first_line(e: BaseException) -> str:
    """The user's exception behind a Ray error, in one line."""
    cause = getattr(e, "cause", None) or getattr(e, "error", None)
    if isinstance(cause, BaseException):
        e = cause
    text = str(e).strip().splitlines()
    lines = [ln for ln in text if ln.strip() and not ln.startswith((" ", "Traceback"))]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"


# ------------------------------------------------------------------------------ producer side


_connect_lock = threading.Lock()


class _DropThreadNotice(logging.Filter):
    """Ray notes that a ``ray.init`` off the main thread leaves SIGTERM alone: that is the
    intent here (the producer stops gracefully on SIGTERM), so the note is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def _ensure_connected(handle: dict[str, Any]) -> Any:
    """``ray.init`` once per process (blocking; run in a thread, so Ray leaves the producer's
    SIGTERM handling alone)."""
    # Ray's failure signal handler would print a stack dump for the SIGTERM that stops a
    # producer (read from the environment, or from ray_constants once Ray is imported).
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    import ray
    from ray._private import ray_constants

    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    logging.getLogger("ray._private.worker").addFilter(_DropThreadNotice())
    with _connect_lock:
        if not ray.is_initialized():
            kw: dict[str, Any] = {
                "address": handle["address"],
                "namespace": handle["namespace"],
                "log_to_driver": False,  # the driver already prints the replicas' output
                "configure_logging": False,
            }
            ip = os.environ.get(NODE_IP_ENV) or loopback_host(handle["address"])
            if ip:
                kw["_node_ip_address"] = ip
            ray.init(**kw)
    return ray


def loopback_host(address: str) -> str:
    """The host of a cluster address on loopback (``127.x``), where this process must join as
    that node; "" for any other address (Ray finds this node's address itself)."""
    host = address.rsplit(":", 1)[0]
    return host if host.startswith("127.") else ""


class RayRewardClient:
    """A producer's link to one ray reward's replicas."""

    def __init__(self, name: str, handle: dict[str, Any], on_retry: Callable[[], None]) -> None:
        self.name = name
        self.handle = handle
        self.names: list[str] = list(handle["rewards"][name])
        self.turns = RoundRobin(len(self.names))
        self.on_retry = on_retry
        self._actors: list[Any] | None = None
        self._ray: Any = None

    @classmethod
    def from_env(cls, name: str, on_retry: Callable[[], None]) -> RayRewardClient:
        raw = os.environ.get(HANDLE_ENV)
        handle = json.loads(raw) if raw else {}
        if name not in handle.get("rewards", {}):
            raise RuntimeError(
                f"reward {name!r} has executor ray but this process was not started by a run "
                "that started its replicas (run with --launcher ray, or --ray-address)"
            )
        return cls(name, handle, on_retry)

    def _lookup(self) -> list[Any]:
        ray = _ensure_connected(self.handle)
        ns = self.handle["namespace"]
        actors = [ray.get_actor(n, namespace=ns) for n in self.names]
        self._ray = ray
        return actors

    async def call(self, method: str, args: Any) -> Any:
        """One remote call on the next replica; retried once on the next one if its replica
        died (or was restarting) under it."""
        if self._actors is None:
            self._actors = await asyncio.to_thread(self._lookup)
        ray = self._ray
        for attempt in (0, 1):
            k = self.turns.take()
            ref = getattr(self._actors[k], method).remote(args)
            try:
                return await ref
            except ray.exceptions.RayTaskError as e:  # the reward raised: its error, one line
                raise RuntimeError(_first_line(e)) from None
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                if attempt:
                    raise
                self.on_retry()
                log.warning(
                    "reward %s: replica %s failed under the call (%s); retrying on the next one",
                    self.name,
                    self.names[k],
                    type(e).__name__,
                )
            except asyncio.CancelledError:
                if isinstance(ref, ray.ObjectRef):  # (ray.cancel would start Ray if it is not)
                    with contextlib.suppress(Exception):
                        ray.cancel(ref)  # a call still queued at the replica is dropped there
                raise
        raise AssertionError("unreachable")
