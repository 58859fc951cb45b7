"""Weight routes: how a snapshot gets from the learner into every vLLM worker of a producer.

One module per route, holding both of its ends: the producer end, a
``sync.routes.base.WeightRoute`` (the barrier's prepare and load for a version), and for the GPU
routes the learner end, a ``sync.routes.base.LearnerEnd`` (what the learner holds and does for
the producers on that route):

- ``file`` (``sync.routes.file``): the snapshot file, written for every version whatever the
  route; the default on CPU and the fallback of the GPU routes;
- ``stream`` (``sync.routes.stream``): the file route for a producer on another machine, the
  file streamed over the network first (``sync.stream_from``);
- ``ipc`` (``sync.routes.ipc``): the learner's packed GPU copy, opened by CUDA IPC (same GPU);
- ``nccl`` (``sync.routes.nccl``): the packed copy broadcast over a NCCL link (other GPUs).

The GPU routes share the learner's packed copy of the newest versions (``sync.routes.gpu_copy``).
The learner names ``file``, ``ipc`` or ``nccl`` per producer in its Announce
(``sync.routes.base.choose_route``); a producer reads what the learner calls the file by its own
file or stream route. ``make_route`` builds a producer end by name, ``learner_ends`` the learner
ends; ``plan_route`` says which route an announced version can actually take here.
"""

from __future__ import annotations

from typing import Any

from sync.routes.base import LearnerEnd, RouteName, WeightRoute
from sync.routes.file import FileRoute
from sync.routes.ipc import IpcLearnerEnd, IpcRoute
from sync.routes.nccl import NcclLearnerEnd, NcclRoute
from sync.routes.stream import StreamRoute

ROUTES: dict[str, type[WeightRoute]] = {
    r.name: r for r in (FileRoute, StreamRoute, IpcRoute, NcclRoute)}
LEARNER_ENDS: dict[str, type[LearnerEnd]] = {e.name: e for e in (IpcLearnerEnd, NcclLearnerEnd)}


def make_route(name: str, engine: Any, **options: Any) -> WeightRoute:
    """The producer end of route ``name`` on ``engine`` (``options``: its constructor's)."""
    return ROUTES[name](engine, **options)


def learner_ends(copies: Any, timeout_s: float) -> dict[str, LearnerEnd]:
    """The learner end of each GPU route, by name, over ``copies`` (a
    ``sync.routes.gpu_copy.GpuCopies``); ``timeout_s`` bounds each transfer and link set-up."""
    return {name: end(copies, timeout_s) for name, end in LEARNER_ENDS.items()}


def takes_gpu_copy(route: str) -> bool:
    """Whether route ``route`` (as named in an Announce) carries the learner's packed GPU copy:
    the routes with a learner end (ipc, nccl)."""
    return route in LEARNER_ENDS


def plan_route(route: str, transfer: dict[str, Any], producer_id: str, my_gpus: list[str],
               joined: bytes | None) -> tuple[RouteName, str]:
    """What a producer actually uses for an announced version: the learner's route if its payload
    is there and usable here (``joined``: the unique id of the NCCL link we hold), else ``file``,
    with the reason (logged by the caller)."""
    if not takes_gpu_copy(route):  # the learner names only file and the GPU routes
        return "file", "" if route in ("", "file") else f"unknown route {route!r}"
    why = ROUTES[route].unusable(transfer, producer_id, my_gpus, joined)
    return ("file", why) if why else (route, "")  # type: ignore[return-value]
