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


class KeepingLoraEngine(FakeLoraEngine):
    """As vLLM's LRU adapter manager: an adapter id it holds already is not loaded again (the
    weights it holds stay, and add_lora returns True)."""

    def __init__(self):
        super().__init__()
        self.paths: dict[int, str] = {}

    async def add_lora(self, req) -> bool:
        self.paths.setdefault(req.lora_int_id, req.lora_path)
        return await super().add_lora(req)

    async def remove_lora(self, lora_id: int) -> bool:
        self.paths.pop(lora_id, None)
        return await super().remove_lora(lora_id)


def test_a_restarted_learners_version_under_an_old_number_is_a_new_adapter(tmp_path):
    """v1 and v2 ran; the learner restarts from v1's checkpoint and trains v2 anew: the engine
    serves the new v2's adapter (not the old one, held under the same id), and the old v2's
    adapter leaves the engine."""
    def ref(v: int, value: float, where: str):
        return write_snapshot({f"{P}.lora_A.weight": torch.full((2, 4), value),
                               f"{P}.lora_B.weight": torch.zeros(4, 2)}, v, tmp_path / where)

    eng = KeepingLoraEngine()
    ad = AdapterSet(eng, "lora-p0", adapter_config(2, 4.0, ["q_proj"]))
    tracker = RequestTracker()

    async def main():
        for v in (1, 2):
            assert (await ad.swap(ref(v, v, "s1"), tracker)).ok
        old_v2 = ad.requests[2]
        assert (await ad.swap(ref(1, 1.0, "s2"), tracker)).ok  # the restarted learner's v1
        assert (await ad.swap(ref(2, 5.0, "s2"), tracker)).ok  # its v2: other weights
        new_v2 = ad.request_for(await tracker.admit("r"))
        served = eng.paths[new_v2.lora_int_id]
        assert "/s2/" in served and served == new_v2.lora_path, served
        assert old_v2.lora_int_id not in eng.loaded

    asyncio.run(main())
