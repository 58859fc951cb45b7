"""NCCL link bookkeeping on the learner (``sync.publish.WeightPublisher``) with a fake
``nccl.connect``: the races a GPU run can hit (a join outliving its deadline, a producer that
restarts or drops mid-join, a join of an offer that already expired) and the daemon-thread
helper they rely on. Real links are exercised by tests/e2e/test_gpu_transports.py on GPUs."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from sync import nccl
from sync.publish import EXPIRED, WeightPublisher
from sync.threads import in_daemon_thread


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


def _publisher(timeout_s: float = 5.0) -> WeightPublisher:
    return WeightPublisher("cpu", timeout_s=timeout_s, gpu_uuid="GPU-fake")


async def _join_under_way(pub: WeightPublisher) -> tuple:
    """An offered link to p0 and the learner's join of it, blocked in the fake connect."""
    pub.maintain({"p0": (True, 2)})
    link = pub.links["p0"]
    joining = asyncio.ensure_future(pub.join("p0", link.epoch))
    await asyncio.sleep(0.05)
    return link, joining


async def _settle(pred, what: str, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


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


def test_in_daemon_thread_result_error_and_orphan():
    orphans: list = []

    async def main():
        assert await in_daemon_thread(lambda x: x + 1, 1) == 2
        with pytest.raises(ValueError):
            await in_daemon_thread(_raise, ValueError("boom"))
        gate = threading.Event()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(in_daemon_thread(lambda: gate.wait(5) and "late comm",
                                                    on_orphan=orphans.append), 0.05)
        gate.set()
        await _settle(lambda: orphans, "the late result reaches on_orphan")

    asyncio.run(main())
    assert orphans == ["late comm"]
    threads = [t for t in threading.enumerate() if t.name.startswith("daemon-")]
    assert all(t.daemon for t in threads)


def _raise(e):
    raise e


def test_join_that_outlives_its_deadline_fails_and_its_late_comm_is_aborted_fake_nccl(
        monkeypatch):
    fake = FakeNccl(monkeypatch)

    async def main():
        pub = _publisher(timeout_s=0.1)
        pub.maintain({"p0": (True, 2)})
        link = pub.links["p0"]
        await pub.join("p0", link.epoch)
        assert link.state == "dead" and pub.link_failures["p0"] == 1
        fake.gate.set()  # the peer turns up after all
        await _settle(lambda: fake.comms and fake.comms[0].aborted, "late comm aborted")

    asyncio.run(main())


def test_producer_restart_during_a_join_aborts_the_orphan_and_counts_nothing_fake_nccl(
        monkeypatch):
    fake = FakeNccl(monkeypatch)

    async def main():
        pub = _publisher()
        old, joining = await _join_under_way(pub)
        pub.forget("p0")  # a new Hello with another pid
        pub.maintain({"p0": (True, 2)})
        new = pub.links["p0"]
        fake.gate.set()
        await joining
        assert old.state == "dead" and old.comm is None
        assert new.state == "offered" and pub.link_failures.get("p0", 0) == 0
        await _settle(lambda: fake.comms and fake.comms[0].aborted, "orphan comm aborted")

    asyncio.run(main())


def test_a_drop_during_a_join_that_then_fails_counts_one_failure_fake_nccl(monkeypatch):
    fake = FakeNccl(monkeypatch)
    fake.fail = RuntimeError("NCCL error: remote process exited")

    async def main():
        pub = _publisher()
        link, joining = await _join_under_way(pub)
        assert pub.drop("p0", link.epoch)
        fake.gate.set()
        await joining
        assert link.state == "dead" and pub.link_failures["p0"] == 1

    asyncio.run(main())


def test_a_late_join_of_an_expired_offer_is_completed_and_aborted_fake_nccl(monkeypatch):
    fake = FakeNccl(monkeypatch)
    fake.gate.set()

    async def main():
        pub = _publisher(timeout_s=0.01)
        pub.maintain({"p0": (True, 2)})
        stale = pub.links["p0"]
        stale.since = time.monotonic() - 1.0  # an announce carried it a second ago
        pub.maintain({"p0": (True, 2)})  # expired: a new epoch is offered
        assert stale.error == EXPIRED and pub.links["p0"].epoch == stale.epoch + 1
        await pub.join("p0", stale.epoch)  # the producer read the old announce late
        await _settle(lambda: fake.comms and fake.comms[0].aborted, "stale link aborted")
        assert fake.comms[0].uid == stale.unique_id
        assert pub.links["p0"].state == "offered"  # the newer offer stands
        await pub.join("p0", stale.epoch)  # only once: a second late join is just ignored
        await asyncio.sleep(0.05)
        assert len(fake.comms) == 1

    asyncio.run(main())


def test_drop_host_versions_leaves_gpu_versions_and_counts_the_dropped():
    """Before the final checkpoint the learner lets go of versions held in host memory (a
    sharded learner's); a version on the GPU (``is_cuda``, faked here) stays offered."""
    pub = _publisher()
    on_gpu = SimpleNamespace(is_cuda=True)
    pub._held.update({1: (torch.zeros(4), None, {}, []), 2: (on_gpu, None, {}, []),
                      3: (torch.zeros(4), None, {}, [])})
    assert pub.drop_host_versions() == 2
    assert pub.held() == [2]
    assert pub.drop_host_versions() == 0
