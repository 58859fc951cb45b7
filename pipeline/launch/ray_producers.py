"""The Ray driver's view of the producer actors (``pipeline.launch.ray``): one poll in flight
each, restarts, lost nodes, deaths for good, and the producers of an elastic run that join and
leave."""

from __future__ import annotations

import logging
import time
from typing import Any

from pipeline.launch.console import tell

log = logging.getLogger(__name__)


DEAD_CONFIRM = 3  # failed calls in a row before an actor counts as dead for good


def dead_for_good(ray: Any, call: Any, tries: int = DEAD_CONFIRM) -> bool:
    """Whether an actor whose call just failed with RayActorError is dead for good: a call in
    flight when the actor's process dies fails even when Ray restarts the actor, so the call is
    repeated; one that is answered (or queued for the restarted actor) means it lives."""
    for _ in range(tries):
        time.sleep(1.0)
        try:
            ray.get(call(), timeout=5)
            return False
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            return False
        except ray.exceptions.RayError:
            continue
    return True


class ProducerWatch:
    """The driver's view of the producer actors: one poll in flight each (never blocking the
    loop on an actor that waits for a node), restarts and lost nodes reported on the console."""

    def __init__(self, ray: Any, actors: dict[int, Any], infos: list[dict],
                 evaluator: int | None = None):
        """``evaluator``: the dedicated evaluator's index among ``actors`` (None: none)."""
        self.ray, self.actors, self.evaluator = ray, actors, evaluator
        self.pid = {i: info["pid"] for i, info in zip(actors, infos, strict=True)}
        self.node = {i: info["node_id"] for i, info in zip(actors, infos, strict=True)}
        self.ip = {i: info["ip"] for i, info in zip(actors, infos, strict=True)}
        self.calls: dict[int, Any] = {}
        self.lost: set[int] = set()  # node gone; Ray restarts it when a node fits its bundle
        self.dead: set[int] = set()  # for good
        self.leaving: set[int] = set()  # asked to leave (pipeline-train scale)
        self.left: set[int] = set()  # left cleanly: never restarted, never polled again
        self.nodes_checked = 0.0

    def add(self, i: int, actor: Any, info: dict) -> None:
        """A producer that joins the run (``pipeline-train scale``)."""
        self.actors[i] = actor
        self.pid[i], self.node[i], self.ip[i] = info["pid"], info["node_id"], info["ip"]

    def running(self) -> list[int]:
        """The training producers that run and are not leaving."""
        return sorted(set(self.actors) - self.lost - self.dead - self.leaving - self.left
                      - {self.evaluator})

    def _lost(self, i: int) -> None:
        """Producer ``i``'s node left the cluster: said once, whichever check sees it first."""
        self.lost.add(i)
        log.error(
            "producer %d lost: its node %s (%s) left the cluster; the run goes on with %d "
            "producer(s); Ray restarts it where its bundle fits, if restarts are left "
            "(--max-producer-restarts)",
            i,
            self.node[i][:12],
            self.ip[i],
            len(set(self.actors) - self.lost - self.dead - self.left - {self.evaluator}),
        )

    def check(self) -> bool:
        """False when the run must stop (a producer died for good other than by node loss, or
        no producer is left)."""
        ray = self.ray
        if time.monotonic() - self.nodes_checked > 1.0:
            self.nodes_checked = time.monotonic()
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            for i in sorted(set(self.actors) - self.lost - self.dead - self.left):
                if self.node[i] not in alive:
                    self._lost(i)
        for i, actor in self.actors.items():
            if i in self.dead or i in self.left:
                continue
            ref = self.calls.get(i) or self.calls.setdefault(i, actor.poll.remote())
            done, _ = ray.wait([ref], timeout=0)
            if not done:
                continue
            del self.calls[i]
            try:
                st = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:
                continue
            except ray.exceptions.RayError as e:  # the actor died (or Ray's OOM killer)
                if i not in self.lost and not dead_for_good(ray, actor.poll.remote):
                    continue
                self.dead.add(i)
                if i == self.evaluator:
                    log.error("the evaluator died and Ray will not restart it; training goes on "
                              "without evaluation: %s", str(e).splitlines()[0])
                    continue
                left = len(set(self.actors) - self.dead - self.left - {self.evaluator})
                alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
                if i not in self.lost and self.node[i] not in alive:
                    self._lost(i)  # its death was seen before the node check saw the node go
                if i in self.lost and left:
                    log.error("producer %d is gone for good with its node; %d left", i, left)
                    continue
                log.error(
                    "producer %d died and Ray will not restart it (launch restarts exhausted): %s",
                    i,
                    str(e).splitlines()[0],
                )
                return False
            if i in self.leaving and st["exit"] is not None:
                self.leaving.discard(i)
                self.left.add(i)
                if st["exit"] == 0:
                    tell(log, f"producer {i} left the run")
                else:
                    log.error("producer %d died while leaving (exit %s); groups of it that no "
                              "checkpoint holds stay in its outbox log", i, st["exit"])
                continue
            if st["pid"] != self.pid[i]:
                log.warning(
                    "producer %d restarted by Ray (pid %s -> %s) on node %s (%s)",
                    i,
                    self.pid[i],
                    st["pid"],
                    st["node_id"][:12],
                    st["ip"],
                )
                self.pid[i], self.node[i], self.ip[i] = st["pid"], st["node_id"], st["ip"]
                self.lost.discard(i)
        return True
