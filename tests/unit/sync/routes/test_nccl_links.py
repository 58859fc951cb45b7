"""The nccl route's learner end (``sync.routes.nccl.NcclLearnerEnd``) with a fake
``nccl.connect``: the races a GPU run can hit (a join outliving its deadline, a producer that
restarts or drops mid-join, a join of an offer that already expired), how SyncReady messages are
answered, and the communicator's helpers (``sync.nccl``). Real links are exercised by
tests/e2e/test_gpu_transports.py on GPUs."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from buffer.protocol import SyncReady, decode, encode
from sync import nccl
from sync.nccl import LinkError, NcclUnavailable
from sync.routes.gpu_copy import GpuCopies
from sync.routes.nccl import (
    EXPIRED,
    Link,
    NcclLearnerEnd,
    link_droppable,
    link_due,
    permanent_link_error,
    ready_reply,
)
from tests.waiting import settle


class FakeComm:
    def __init__(self, uid: bytes):
        self.uid, self.aborted, self.disabled = uid, False, False


class FakeNccl:
    """Stands in for libnccl: ``connect`` blocks until ``release`` (the peer joins) or fails."""

    def __init__(self, monkeypatch):
        self.n = 0
        self.gate = threading.Event()
        self.fail: Exception | None = None
        self.comms: list[FakeComm] = []
        monkeypatch.setattr(nccl, "new_unique_id", self._uid)
        monkeypatch.setattr(nccl, "connect", self._connect)
        monkeypatch.setattr(nccl, "abort", self._abort)

    def _uid(self) -> bytes:
        self.n += 1
        return bytes([self.n]) * 128

    def _connect(self, uid, rank, world, device):
        assert rank == 0 and device == torch.device("cpu")
        if not self.gate.wait(5):
            raise AssertionError("fake peer never joined")
        if self.fail is not None:
            raise self.fail
        comm = FakeComm(uid)
        self.comms.append(comm)
        return comm

    @staticmethod
    def _abort(comm):
        comm.aborted = True


def _end(timeout_s: float = 5.0) -> NcclLearnerEnd:
    return NcclLearnerEnd(GpuCopies("cpu", gpu_uuid="GPU-fake"), timeout_s=timeout_s)


async def _join_under_way(end: NcclLearnerEnd) -> tuple:
    """An offered link to p0 and the learner's join of it, blocked in the fake connect."""
    end.maintain({"p0": (True, 2)})
    link = end.links["p0"]
    joining = asyncio.ensure_future(end.join("p0", link.epoch))
    await asyncio.sleep(0.05)
    return link, joining


def test_keep_current_stream_restores_the_threads_stream_with_fakes():
    current = ["default"]

    def put(s):
        current[0] = s

    with pytest.raises(RuntimeError), \
            nccl.keep_current_stream(0, get=lambda d: current[0], put=put):
        current[0] = "vllm side stream"  # what PyNcclCommunicator's constructor does
        raise RuntimeError("join failed")
    assert current == ["default"]


def test_timed_broadcast_refuses_an_aborted_link_with_a_fake_comm():
    comm = SimpleNamespace(disabled=True)  # vLLM's broadcast would silently do nothing
    with pytest.raises(nccl.LinkError, match="aborted"):
        nccl.timed_broadcast(comm, torch.zeros(2), deadline=time.monotonic() + 1, what="header")


def test_join_that_outlives_its_deadline_fails_and_its_late_comm_is_aborted_fake_nccl(
        monkeypatch):
    fake = FakeNccl(monkeypatch)

    async def main():
        end = _end(timeout_s=0.1)
        end.maintain({"p0": (True, 2)})
        link = end.links["p0"]
        await end.join("p0", link.epoch)
        assert link.state == "dead" and end.link_failures["p0"] == 1
        fake.gate.set()  # the peer turns up after all
        await settle(lambda: fake.comms and fake.comms[0].aborted, "late comm aborted")

    asyncio.run(main())


def test_producer_restart_during_a_join_aborts_the_orphan_and_counts_nothing_fake_nccl(
        monkeypatch):
    fake = FakeNccl(monkeypatch)

    async def main():
        end = _end()
        old, joining = await _join_under_way(end)
        end.forget("p0")  # a new Hello with another pid
        end.maintain({"p0": (True, 2)})
        new = end.links["p0"]
        fake.gate.set()
        await joining
        assert old.state == "dead" and old.comm is None
        assert new.state == "offered" and end.link_failures.get("p0", 0) == 0
        await settle(lambda: fake.comms and fake.comms[0].aborted, "orphan comm aborted")

    asyncio.run(main())


def test_a_drop_during_a_join_that_then_fails_counts_one_failure_fake_nccl(monkeypatch):
    fake = FakeNccl(monkeypatch)
    fake.fail = RuntimeError("NCCL error: remote process exited")

    async def main():
        end = _end()
        link, joining = await _join_under_way(end)
        assert end.drop("p0", link.epoch)
        fake.gate.set()
        await joining
        assert link.state == "dead" and end.link_failures["p0"] == 1

    asyncio.run(main())


def test_a_late_join_of_an_expired_offer_is_completed_and_aborted_fake_nccl(monkeypatch):
    fake = FakeNccl(monkeypatch)
    fake.gate.set()

    async def main():
        end = _end(timeout_s=0.01)
        end.maintain({"p0": (True, 2)})
        stale = end.links["p0"]
        stale.since = time.monotonic() - 1.0  # an announce carried it a second ago
        end.maintain({"p0": (True, 2)})  # expired: a new epoch is offered
        assert stale.error == EXPIRED and end.links["p0"].epoch == stale.epoch + 1
        await end.join("p0", stale.epoch)  # the producer read the old announce late
        await settle(lambda: fake.comms and fake.comms[0].aborted, "stale link aborted")
        assert fake.comms[0].uid == stale.unique_id
        assert end.links["p0"].state == "offered"  # the newer offer stands
        await end.join("p0", stale.epoch)  # only once: a second late join is just ignored
        await asyncio.sleep(0.05)
        assert len(fake.comms) == 1

    asyncio.run(main())


def test_sync_ready_link_and_weights_become_tasks_a_drop_is_done_at_once_fake_nccl(
        monkeypatch):
    FakeNccl(monkeypatch)
    end = _end()
    end.maintain({"p0": (True, 2)})
    link = end.links["p0"]
    for purpose in ("link", "weights"):
        coro = end.on_sync_ready("p0", purpose, link.epoch, 1)
        assert asyncio.iscoroutine(coro)
        coro.close()
    assert end.on_sync_ready("p0", "drop", link.epoch, 0) is None
    assert link.state == "dead" and end.link_failures["p0"] == 1


def test_offers_only_live_links_of_the_producers_asked_and_start_their_clock_fake_nccl(
        monkeypatch):
    FakeNccl(monkeypatch)
    end = _end()
    end.maintain({"p0": (True, 2), "p1": (True, 3)})
    assert end.links["p0"].since is None
    got = end.offer(1, ["p0"])
    assert list(got["nccl"]) == ["p0"] and got["nccl"]["p0"]["world_size"] == 2
    assert end.links["p0"].since is not None and end.links["p1"].since is None
    end.links["p0"].state = "dead"
    assert end.offer(1, ["p0"]) == {}


# ------------------------------------------------------------------ link bookkeeping
def test_ready_reply_decisions():
    up = Link("p0", 5, b"u" * 128, 2, state="ready")
    assert ready_reply(up, 5, 7, held=[6, 7]) == "send"
    assert ready_reply(up, 5, 5, held=[6, 7]) == "refuse"       # v gone: header -1, file
    assert ready_reply(up, 4, 7, held=[6, 7]) == "ignore"       # stale epoch
    assert ready_reply(None, 5, 7, held=[7]) == "ignore"
    assert ready_reply(Link("p0", 5, b"", 2, state="dead"), 5, 7, [7]) == "ignore"


def test_link_due_offers_retries_and_gives_up():
    now = time.monotonic()
    assert link_due(None, alive=True, now=now, timeout_s=30, failures=0, max_failures=3)
    assert not link_due(None, alive=False, now=now, timeout_s=30, failures=0, max_failures=3)
    assert not link_due(None, alive=True, now=now, timeout_s=30, failures=3, max_failures=3)
    offered = Link("p0", 1, b"", 2, since=now - 31)
    assert link_due(offered, True, now, 30, 0, 3) and offered.state == "dead"
    fresh = Link("p0", 1, b"", 2, since=now)
    assert not link_due(fresh, True, now, 30, 0, 3)
    unannounced = Link("p0", 1, b"", 2)  # no announce carried it yet: it does not expire
    assert not link_due(unannounced, True, now + 3600, 30, 0, 3)
    assert unannounced.state == "offered"
    assert not link_due(Link("p0", 1, b"", 2, state="ready"), True, now, 30, 0, 3)


def test_permanent_link_errors_stop_offers_transient_ones_retry():
    # The split-layout failure on 2 H200s was an AssertionError of our own process: each retry
    # would have stalled the producer nccl_timeout_s again.
    for e in (AssertionError("created to work on cuda, but the input tensor is on cuda:0"),
              NcclUnavailable("no libnccl"), ValueError("bad world size")):
        assert permanent_link_error(e), e
    for e in (TimeoutError(), LinkError("broadcast timed out"), RuntimeError("NCCL error")):
        assert not permanent_link_error(e), e
    # ... and a producer at max_link_failures gets no further offer.
    assert not link_due(None, alive=True, now=0.0, timeout_s=30.0, failures=3, max_failures=3)


def test_a_producer_drop_applies_to_its_live_link_of_that_epoch_only():
    link = Link("p0", 4, b"u" * 128, 2)
    for state in ("offered", "joining", "ready"):
        link.state = state
        assert link_droppable(link, 4)
    assert not link_droppable(link, 3)  # an older epoch's drop arriving late
    link.state = "dead"
    assert not link_droppable(link, 4) and not link_droppable(None, 4)
    msg = SyncReady(producer_id="p0", incarnation="p0-1", purpose="drop", epoch=4, version=0)
    assert decode(encode(msg)) == (0, msg)
