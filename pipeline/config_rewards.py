"""One reward of the run configuration (``rewards.specs`` of ``pipeline.config``): what to call,
how to weigh it and how to run it. Declared like every section: type, bounds ``opt(...)`` and
the docstring under each field."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.options import check, enforce, opt

Executor = Literal["inline", "thread", "process", "ray"]
RAY_ONLY = ("num_replicas", "num_cpus", "num_gpus", "max_restarts")
RewardStyle = Literal["auto", "native", "trl"]


@dataclass
class RewardSpec:
    """One reward of the config: what to call, how to weigh it and how to run it."""

    fn: str | Callable[..., Any]
    """Import path ``package.module:attr`` or ``path/to/file.py:attr`` (or, from Python, the
    function/class itself; for ``executor="process"`` it must then be importable by reference)."""
    weight: float | None = None
    """Multiplier in the weighted sum; None takes the ``@reward`` default, else 1.0."""
    name: str | None = None
    """Name in logs, stats and the breakdown; None takes the ``@reward`` default, else the attr."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Constructor keyword arguments when ``fn`` is a class (ignored for functions)."""
    batched: bool | None = None
    """Scorer takes lists for the whole group; None takes the ``@reward`` default, else False."""
    timeout_s: float = opt(30.0, gt=0)
    """Per-call time limit; a call past it counts as a failure (timeout)."""
    executor: Executor = "inline"
    """inline: on the event loop (async or fast sync rewards); thread: blocking sync rewards;
    process: CPU-heavy rewards in a spawn ProcessPoolExecutor; ray: a reward class (e.g. a
    learned reward model) as Ray actors shared by all producers of the run (needs
    ``--launcher ray``, or ``--ray-address`` with the local launcher)."""
    max_concurrency: int | None = opt(None, ge=1)
    """Upper bound on this reward's concurrent calls (None: unbounded)."""
    rate_per_s: float | None = opt(None, gt=0)
    """Upper bound on this reward's call starts per second, for remote (HTTP) rewards."""
    style: RewardStyle = "auto"
    """Calling convention. native: ``r(prompt, completion, **meta)`` (or the batched form);
    trl: TRL GRPOTrainer's ``f(completions, **kwargs) -> list[float | None]``, one call per
    group with ``prompts``, ``completion_ids`` and the dataset's columns as lists; auto: trl
    when the signature names ``completions``/``completion_ids`` and not ``completion``/``metas``
    (and ``batched`` is not set), else native."""
    num_replicas: int | None = opt(None, ge=1)
    """executor ray: actors serving this reward, shared by every producer (None: 1)."""
    num_cpus: float | None = opt(None, ge=0)
    """executor ray: CPUs each replica reserves on the cluster (None: 1)."""
    num_gpus: float | None = opt(None, ge=0)
    """executor ray: GPUs each replica reserves, e.g. 1 for a learned reward model (None: 0)."""
    max_restarts: int | None = opt(None, ge=-1)
    """executor ray: how often Ray restarts a replica that dies (-1: without limit; None: 3)."""

    def __post_init__(self) -> None:
        enforce(self)  # named relative to its list entry, which options.build puts in front
        for name in RAY_ONLY:
            check(getattr(self, name) is None or self.executor == "ray", name,
                  f"applies only to executor: ray (this reward's executor is {self.executor})")
        check(not isinstance(self.fn, str) or ":" in self.fn, "fn",
              f"must look like 'package.module:attr' or 'path/to/file.py:attr', got {self.fn!r}")
        check(self.style != "trl" or not self.batched, "batched",
              "style trl is already one call per group; leave batched unset")
