"""pipeline.producer.adapters.AdapterSet with a fake engine (FakeLoraEngine records add_lora /
remove_lora; the real engine is in tests/e2e/test_lora_sync.py): requests keep their version's
adapter, and an adapter leaves the engine once it is neither current nor in use."""

from __future__ import annotations

import asyncio

import torch

from pipeline.producer.adapters import AdapterSet
from sync.barrier import RequestTracker
from sync.lora import adapter_config
from sync.snapshot import write_snapshot

P = "base_model.model.model.layers.0.self_attn.q_proj"


class FakeLoraEngine:
    def __init__(self):
        self.loaded: set[int] = set()

    async def add_lora(self, req) -> bool:
        self.loaded.add(req.lora_int_id)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.loaded.discard(lora_id)
        return True


def test_adapters_follow_requests_and_are_removed_when_unused(tmp_path):
    snaps = tmp_path / "snaps"
    refs = {
        v: write_snapshot(
            {
                f"{P}.lora_A.weight": torch.full((2, 4), float(v)),
                f"{P}.lora_B.weight": torch.zeros(4, 2),
            },
            v,
            snaps,
        )
        for v in (1, 2, 3)
    }
    eng = FakeLoraEngine()
    ad = AdapterSet(eng, "lora-p0", adapter_config(2, 4.0, ["q_proj"]))

    async def main():
        assert ad.request_for(0) is None  # base weights: no adapter
        await ad.release(0)
        await ad.stage(refs[1])
        assert eng.loaded == {1} and ad.current == 0  # staged, not yet used by new requests
        await ad.switch(1)
        r1 = ad.request_for(1)
        assert r1.lora_int_id == 1 and r1.lora_name == "v1"
        assert (snaps / "lora-p0" / "v1" / "adapter_model.safetensors").is_file()
        await ad.stage(refs[2])
        await ad.switch(2)
        assert eng.loaded == {1, 2}  # v1 still has a request in flight
        await ad.release(1)
        assert eng.loaded == {2} and not (snaps / "lora-p0" / "v1").exists()
        await ad.stage(refs[3])
        await ad.switch(3)
        assert eng.loaded == {3}  # v2 had no request left
        ad.close()
        assert not (snaps / "lora-p0").exists()

    asyncio.run(main())


def test_swap_switches_version_and_adapter_together_without_pausing(tmp_path):
    ref = write_snapshot(
        {f"{P}.lora_A.weight": torch.ones(2, 4), f"{P}.lora_B.weight": torch.zeros(4, 2)},
        1,
        tmp_path,
    )
    eng = FakeLoraEngine()  # has no pause_generation: a pause would raise
    ad = AdapterSet(eng, "lora-p0", adapter_config(2, 4.0, ["q_proj"]))
    tracker = RequestTracker()

    async def main():
        rep = await ad.swap(ref, tracker)
        assert rep.ok and rep.version == 1 and tracker.version == 1 and ad.current == 1
        assert rep.timings["idle_s"] == 0.0 and rep.timings["prepare_bytes"] > 0
        v = await tracker.admit("r")
        assert ad.request_for(v).lora_int_id == 1
        bad = type(ref)(2, ref.uri, "blake3:" + "0" * 32)
        rep = await ad.swap(bad, tracker)
        assert not rep.ok and "checksum" in rep.error and tracker.version == 1

    asyncio.run(main())
