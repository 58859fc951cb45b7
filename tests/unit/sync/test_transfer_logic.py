"""GPU weight routes, the parts that need no GPU: route choice per placement, route planning
and fallback decisions, packed layouts and their wire form, msgpack-safe IPC handle fields.
Engines here are mocks (named so); the GPU paths themselves are checked by effect in
tests/e2e/test_gpu_transports.py. The nccl route's link bookkeeping:
tests/unit/sync/routes/test_nccl_links.py.
"""

from __future__ import annotations

import asyncio
from functools import partial

import pytest
import torch
from engine_fakes import MockEngine

from buffer.protocol import Announce, SyncReady, decode, encode
from sync import packing
from sync.barrier import RequestTracker, SwapBarrier
from sync.routes import plan_route
from sync.routes.base import RouteChoiceError, choose_route, swap_with_fallback
from sync.routes.file import FileRoute
from sync.routes.nccl import NcclRoute, nccl_offer
from sync.snapshot import SnapshotRef

A, B, C = "GPU-aaaa", "GPU-bbbb", "GPU-cccc"


# ------------------------------------------------------------------ route choice
@pytest.mark.parametrize("learner, producer, want", [
    (None, [], "file"),            # CPU learner, CPU producer
    (A, [], "file"),               # CPU producer
    (None, [A], "file"),           # CPU learner
    (A, [A], "ipc"),               # colocated
    (A, [B], "nccl"),              # another GPU
    (A, [B, C], "nccl"),           # tensor-parallel producer on other GPUs
    (A, [A, B], "file"),           # TP workers straddling the learner's GPU
])
def test_auto_route_per_placement(learner, producer, want):
    assert choose_route("auto", learner, producer) == want


def test_explicit_route_that_cannot_work_is_a_clear_error():
    with pytest.raises(RouteChoiceError, match="needs the learner and the producer on CUDA"):
        choose_route("nccl", None, [])
    with pytest.raises(RouteChoiceError, match="NCCL cannot put two ranks on one GPU"):
        choose_route("nccl", A, [A])
    with pytest.raises(RouteChoiceError, match="use 'nccl'"):
        choose_route("ipc", A, [B])
    with pytest.raises(RouteChoiceError, match="unknown route"):
        choose_route("rdma", A, [B])
    assert choose_route("file", A, [A]) == "file"
    assert choose_route("nccl", A, [B]) == "nccl" and choose_route("ipc", A, [A]) == "ipc"


# ------------------------------------------------------------------ route planning (producer)
def _offer(uid: bytes = b"u" * 128, epoch: int = 3) -> dict:
    return {"epoch": epoch, "unique_id": uid, "world_size": 2, "rank_offset": 1}


def test_plan_route_ipc_needs_its_own_handle_and_the_same_gpu():
    ipc = {"p0": {"gpu_uuid": A}}  # one handle per producer
    assert plan_route("ipc", {"ipc": ipc, "layout": []}, "p0", [A], None) == ("ipc", "")
    used, why = plan_route("ipc", {"ipc": ipc, "layout": []}, "p0", [B], None)
    assert used == "file" and A in why and B in why
    assert plan_route("ipc", {"layout": []}, "p0", [A], None)[0] == "file"
    assert plan_route("ipc", {"ipc": ipc, "layout": []}, "p0", [], None)[0] == "file"
    used, why = plan_route("ipc", {"ipc": ipc, "layout": []}, "p1", [A], None)
    assert used == "file" and "for this producer" in why  # another producer's handle


def test_plan_route_nccl_needs_our_joined_offer():
    t = {"nccl": {"p0": _offer()}, "layout": []}
    assert plan_route("nccl", t, "p0", [B], b"u" * 128) == ("nccl", "")
    assert plan_route("nccl", t, "p0", [B], None) == ("file", "NCCL link epoch 3 not joined")
    # A restarted learner numbers epochs from 1 again: the id, not the epoch, says which link.
    assert plan_route("nccl", t, "p0", [B], b"v" * 128)[0] == "file"
    assert plan_route("nccl", t, "p1", [B], b"u" * 128)[0] == "file"  # offer is for p0 only
    assert plan_route("file", t, "p0", [B], b"u" * 128) == ("file", "")


def test_nccl_offer_is_type_checked():
    assert nccl_offer({"nccl": {"p0": _offer()}}, "p0") == _offer()
    bad = dict(_offer(), unique_id="not-bytes")
    assert nccl_offer({"nccl": {"p0": bad}}, "p0") is None
    assert nccl_offer({"nccl": {"p0": dict(_offer(), epoch=True)}}, "p0") is None
    assert nccl_offer({"nccl": ["p0"]}, "p0") is None and nccl_offer({}, "p0") is None


# ------------------------------------------------------------------ packing
def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "b.bias": torch.randn(7, generator=g),
            "c.idx": torch.arange(6, dtype=torch.int64).reshape(2, 3)}


def test_pack_unpack_round_trip_aligned_on_cpu():
    t = _tensors()
    layout = packing.plan_layout(t)
    assert all(e.offset % packing.ALIGN == 0 for e in layout)
    assert packing.total_bytes(layout) % packing.ALIGN == 0
    flat = packing.pack(t, layout, "cpu")
    out = packing.unpack(flat, layout)
    assert list(out) == list(t)
    for k in t:
        assert out[k].dtype == t[k].dtype and torch.equal(out[k], t[k])
    assert out["a.weight"].data_ptr() == flat.data_ptr()  # views, not copies
    with pytest.raises(packing.PackingError, match="cannot hold"):
        packing.unpack(flat[:10], layout)


def test_layout_wire_round_trip_through_a_real_announce_frame():
    layout = packing.plan_layout(_tensors())
    ann = Announce(version=4, snapshot_uri="/x", snapshot_checksum="c", learner_session="s",
                   received={}, consumed={}, routes={"p0": "ipc"},
                   transfer={"layout": packing.layout_to_wire(layout),
                             "ipc": {"p0": _mock_ipc_fields()}})
    _, got = decode(encode(ann))
    assert packing.layout_from_wire(got.transfer["layout"]) == layout
    assert packing.check_ipc_fields(got.transfer["ipc"]["p0"]) == _mock_ipc_fields()


@pytest.mark.parametrize("row, match", [
    (["w", "bfloat16", [2], 1], "unaligned"),
    (["w", "complex64", [2], 0], "unknown dtype"),
    (["w", "float32", [-1], 0], "bad shape"),
    (["w", "float32", "2", 0], "bad shape"),
    ([1, "float32", [2], 0], "bad or repeated name"),
    (["w", "float32", [2]], "expected"),
])
def test_malformed_layout_rows_are_refused(row, match):
    with pytest.raises(packing.PackingError, match=match):
        packing.layout_from_wire([row])


def test_overlapping_and_repeated_layout_entries_are_refused():
    with pytest.raises(packing.PackingError, match="overlaps"):
        packing.layout_from_wire([["a", "float32", [100], 0], ["b", "float32", [1], 256]])
    with pytest.raises(packing.PackingError, match="repeated"):
        packing.layout_from_wire([["a", "float32", [1], 0], ["a", "float32", [1], 256]])


def test_layout_checked_against_the_model_manifest():
    layout = packing.plan_layout(_tensors())
    manifest = {"a.weight": (3, 5), "b.bias": (7,), "c.idx": (2, 3)}
    packing.check_layout(layout, manifest, 1)
    with pytest.raises(packing.PackingError, match=r"wrong shape for a\.weight"):
        packing.check_layout(layout, dict(manifest, **{"a.weight": (5, 3)}), 1)
    with pytest.raises(packing.PackingError, match="not in the model"):
        packing.check_layout(layout, {"a.weight": (3, 5)}, 1)


def _mock_ipc_fields() -> dict:
    """What ipc_export writes (values made up: no GPU here)."""
    return {"handle": b"\x01" * 64, "storage_size_bytes": 4096, "storage_offset_bytes": 0,
            "ref_counter_handle": b"\x02" * 16, "ref_counter_offset": 8,
            "event_handle": b"\x03" * 64, "event_sync_required": True, "nbytes": 1024,
            "gpu_uuid": A}


@pytest.mark.parametrize("change, match", [
    ({"handle": "text"}, "'handle' has type str"),
    ({"nbytes": True}, "'nbytes' has type bool"),
    ({"nbytes": 10**6}, "exceeds the shared storage"),
    ({"extra": 1}, "expected fields"),
])
def test_mock_ipc_fields_are_checked_before_any_cuda_call(change, match):
    with pytest.raises(packing.PackingError, match=match):
        packing.check_ipc_fields(dict(_mock_ipc_fields(), **change))
    assert packing.check_ipc_fields(dict(_mock_ipc_fields(), event_handle=None))


def test_ipc_fields_need_no_pickle_on_the_wire():
    """Every value is bytes/int/str/bool/None: msgpack carries them as such."""
    allowed = (bytes, int, str, bool, type(None))
    assert all(isinstance(v, allowed) for v in _mock_ipc_fields().values())


# ------------------------------------------------------------------ nccl link, messages
def test_nccl_unique_id_travels_as_bytes():
    from sync.nccl import LinkError, _known_id_group, unique_id_from_bytes

    raw = bytes(range(256))[:128]
    uid = unique_id_from_bytes(raw)
    assert bytes(uid.internal) == raw
    assert _known_id_group(1, 2, uid).broadcast_obj(None, src=0) is uid  # no store, no pickle
    with pytest.raises(LinkError, match="128 bytes"):
        unique_id_from_bytes(b"short")


def test_sync_ready_round_trip_and_purpose_checked():
    msg = SyncReady(producer_id="p1", incarnation="p1-1", purpose="weights", epoch=2, version=9)
    assert decode(encode(msg)) == (0, msg)


# ------------------------------------------------------------------ fallback (mock engine)
def _swap_with(engine: MockEngine, route: str, sent: list):
    async def send_ready(purpose: str, epoch: int, version: int) -> None:
        sent.append((purpose, epoch, version))

    async def main():
        barrier = SwapBarrier(engine, RequestTracker(), settle_s=0.01)
        nccl = NcclRoute(engine, send_ready, timeout_s=1.0)
        nccl.link = _offer()
        ref = SnapshotRef(1, "/snap/policy_v1.safetensors", "blake2b:x")
        transfer = {"layout": [], "nccl": {"p0": _offer()}}
        rep = await swap_with_fallback(barrier, route, ref, FileRoute(engine),
                                       load=partial(nccl.receive_and_apply, ref, transfer))
        return rep, barrier, nccl

    return asyncio.run(asyncio.wait_for(main(), 10))


def test_nccl_receive_runs_inside_the_pause_with_mock_engine():
    engine, sent = MockEngine(), []
    rep, barrier, nccl = _swap_with(engine, "nccl", sent)
    assert rep.ok and rep.version == 1 and "fallback" not in rep.timings
    assert sent == [("weights", 3, 1)]
    assert ("sync_nccl_receive", True) in engine.calls and ("sync_apply_staged", True) in \
        engine.calls
    assert not any(m == "sync_stage_snapshot" for m, _ in engine.calls)
    assert barrier.failures == 0 and nccl.link is not None and not engine.paused


def test_failed_nccl_receive_falls_back_to_the_file_with_mock_engine():
    engine, sent = MockEngine(fail={"sync_nccl_receive"}), []
    rep, barrier, nccl = _swap_with(engine, "nccl", sent)
    # ... and tells the learner to drop its end (it would keep a link we no longer hold).
    assert sent == [("weights", 3, 1), ("drop", 3, 1)]
    assert rep.ok and rep.version == 1 and rep.timings["fallback"] == 1.0
    assert "nccl failed" in rep.error and "mock sync_nccl_receive failed" in rep.error
    assert barrier.failures == 1 and barrier.swaps == 1  # counted, then recovered by file
    assert nccl.link is None  # the worker aborted its communicator: rejoin a new offer
    methods = [m for m, _ in engine.calls]
    assert methods.index("sync_stage_snapshot") > methods.index("sync_nccl_receive")
    assert ("sync_stage_snapshot", False) in engine.calls  # file staged while serving
    assert not engine.paused


def test_file_failing_too_reports_both_and_keeps_the_old_version_with_mock_engine():
    engine = MockEngine(fail={"sync_nccl_receive", "sync_stage_snapshot"})
    rep, barrier, _ = _swap_with(engine, "nccl", [])
    assert not rep.ok and rep.version == 0 and barrier.tracker.version == 0
    assert "nccl failed" in rep.error and "file:" in rep.error and barrier.failures == 2
    assert not engine.paused


def test_file_route_does_not_touch_gpu_routes_with_mock_engine():
    engine, sent = MockEngine(), []
    rep, _, _ = _swap_with(engine, "file", sent)
    assert rep.ok and sent == []
    assert [m for m, _ in engine.calls] == ["sync_stage_snapshot", "sync_apply_staged"]
