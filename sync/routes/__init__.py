"""Weight routes: how a snapshot gets from the learner into every vLLM worker of a producer.

One module per route, each a ``sync.routes.base.WeightRoute`` (producer end: the barrier's
prepare and load for a version; learner side: what the learner publishes for it):

- ``file`` (``sync.routes.file``): the snapshot file, written for every version whatever the
  route; the default on CPU and the fallback of the GPU routes;
- ``stream`` (``sync.routes.stream``): the file route for a producer on another machine, the
  file streamed over the network first (``sync.stream_from``);
- ``ipc`` (``sync.routes.ipc``): the learner's packed GPU copy, opened by CUDA IPC (same GPU);
- ``nccl`` (``sync.routes.nccl``): the packed copy broadcast over a NCCL link (other GPUs).

The learner names ``file``, ``ipc`` or ``nccl`` per producer in its Announce
(``sync.routes.base.choose_route``); a producer reads what the learner calls the file by its own
file or stream route. ``make_route`` builds a route by name; ``plan_route`` says which route an
announced version can actually take here.
"""

from __future__ import annotations

from typing import Any

from sync.routes.base import RouteName, WeightRoute
from sync.routes.file import FileRoute
from sync.routes.ipc import IpcRoute
from sync.routes.nccl import NcclRoute
from sync.routes.stream import StreamRoute

ROUTES: dict[str, type[WeightRoute]] = {
    r.name: r for r in (FileRoute, StreamRoute, IpcRoute, NcclRoute)}


def make_route(name: str, engine: Any, **options: Any) -> WeightRoute:
    """The producer end of route ``name`` on ``engine`` (``options``: its constructor's)."""
    return ROUTES[name](engine, **options)


def route_class(name: str) -> type[WeightRoute]:
    """The route named in an Announce or a producer's record; an unknown name is the file's."""
    return ROUTES.get(name, FileRoute)


def plan_route(route: str, transfer: dict[str, Any], producer_id: str, my_gpus: list[str],
               joined: bytes | None) -> tuple[RouteName, str]:
    """What a producer actually uses for an announced version: the learner's route if its payload
    is there and usable here (``joined``: the unique id of the NCCL link we hold), else ``file``,
    with the reason (logged by the caller)."""
    cls = ROUTES.get(route)
    if cls is None or not cls.gpu_copy:  # the learner names only file and the GPU routes
        return "file", "" if route in ("", "file") else f"unknown route {route!r}"
    why = cls.unusable(transfer, producer_id, my_gpus, joined)
    return ("file", why) if why else (route, "")  # type: ignore[return-value]
