"""LearnerRoutes asks the routes' learner ends (``sync.routes``), never flags: which producers get
a GPU route, what the Announce offers them, whom a SyncReady goes to, what each end maintains
(learner ends and GPU copies are fakes: the real ones need GPUs)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from buffer.protocol import SyncReady
from pipeline.learner.producers import ProducerInfo
from pipeline.learner.routes import LearnerRoutes

A, B = "GPU-aaaa", "GPU-bbbb"


class FakeEnd:
    def __init__(self, name: str):
        self.name, self.calls = name, []

    def offer(self, version, producers):
        return {self.name: {p: version for p in producers}} if producers else {}

    def maintain(self, producers):
        self.calls.append(("maintain", producers))

    def forget(self, producer_id):
        self.calls.append(("forget", producer_id))

    def on_sync_ready(self, producer_id, purpose, epoch, version):
        self.calls.append((purpose, producer_id, epoch, version))
        if purpose == "drop":
            return None

        async def work():
            self.calls.append(("ran", producer_id))
        return work()


def _routes(route="auto", held=(3,), ends=("ipc", "nccl")) -> LearnerRoutes:
    cfg = SimpleNamespace(sync=SimpleNamespace(route=route))
    me = LearnerRoutes(cfg, SimpleNamespace(), {}, {})  # type: ignore[arg-type]
    me.learner_gpu = A
    me.copies = SimpleNamespace(
        newest=lambda at_most: max((v for v in held if v <= at_most), default=None),
        payload=lambda v: {"version": v, "layout": []} if v in held else {})
    me.ends = {name: FakeEnd(name) for name in ends}
    return me


def _hello(me: LearnerRoutes, pid: str, devices: list[str], alive: bool = True) -> None:
    info = me.producers.setdefault(pid, ProducerInfo())
    info.devices = devices
    info.route = me.choose(pid, devices)
    info.last_seen = time.monotonic() if alive else -1e9


def test_a_route_without_a_learner_end_here_is_the_file():
    me = _routes()
    assert me.choose("p0", [A]) == "ipc" and me.choose("p1", [B]) == "nccl"
    assert me.choose("p2", []) == "file"
    assert _routes(ends=("nccl",)).choose("p0", [A]) == "file"  # no ipc end
    assert _routes(ends=()).choose("p1", [B]) == "file"  # a CPU learner, or sync.route file
    assert _routes(route="nccl").choose("p0", [A]) == "file"  # impossible: logged, the file


def test_offer_is_the_copy_and_each_ends_fields_for_its_live_producers():
    me = _routes()
    _hello(me, "p0", [A])
    _hello(me, "p1", [B])
    _hello(me, "p2", [B], alive=False)  # a dead producer gets no GPU copy
    _hello(me, "p3", [])  # file
    routes, transfer = me.offer(5)
    assert routes == {"p0": "ipc", "p1": "nccl"}
    assert transfer == {"version": 3, "layout": [], "ipc": {"p0": 3}, "nccl": {"p1": 3}}
    assert me.offer(2) == ({}, {})  # no copy held at or below v2
    assert me.on_gpu(3) and not me.on_gpu(4)
    assert _routes(held=()).offer(5) == ({}, {})


def test_maintain_and_forget_reach_each_end_with_its_producers():
    me = _routes()
    _hello(me, "p0", [A])
    _hello(me, "p1", [B, A + "x"])
    me.maintain()
    me.forget("p1")
    assert me.ends["nccl"].calls == [("maintain", {"p1": (True, 3)}), ("forget", "p1")]
    assert me.ends["ipc"].calls == [("maintain", {"p0": (True, 2)}), ("forget", "p1")]


def test_sync_ready_goes_to_the_end_of_the_producers_route_as_a_task():
    me = _routes()
    _hello(me, "p1", [B])
    _hello(me, "p3", [])

    def ready(pid, purpose, epoch=4, version=0):
        return SyncReady(producer_id=pid, incarnation=f"{pid}-1", purpose=purpose, epoch=epoch,
                         version=version)

    async def main():
        me.on_sync_ready(ready("p1", "link"))
        me.on_sync_ready(ready("p1", "drop"))
        me.on_sync_ready(ready("p3", "weights", version=3))  # a file producer: ignored
        me.on_sync_ready(ready("p9", "weights", version=3))  # unknown: ignored
        await asyncio.gather(*me._tasks)

    asyncio.run(main())
    assert me.ends["nccl"].calls == [("link", "p1", 4, 0), ("drop", "p1", 4, 0), ("ran", "p1")]
    assert me.ends["ipc"].calls == []
