"""sync.packing.pack_buckets: a version packed bucket by bucket equals one packed whole; every
bucket is consumed even after a failure (each may be a collective other ranks run in step)."""

from __future__ import annotations

import pytest
import torch

from sync.packing import (
    PackingError,
    pack,
    pack_buckets,
    plan_buckets,
    plan_layout,
    plan_layout_of,
    total_bytes,
    unpack,
)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(7, 3, generator=g), "b": torch.randn(300, generator=g),
            "c": torch.randn(5, generator=g), "n": torch.arange(9, dtype=torch.int64)}


def test_bucketed_packing_equals_the_whole_and_casts_to_the_plan():
    t = _tensors()
    plan = {k: (torch.bfloat16 if v.is_floating_point() else v.dtype, tuple(v.shape))
            for k, v in t.items()}
    layout = plan_layout_of(plan)
    whole = pack({k: v.to(plan[k][0]) for k, v in t.items()}, layout, "cpu")
    flat = torch.full((total_bytes(layout),), 7, dtype=torch.uint8)
    buckets = plan_buckets(layout, 64)
    assert len(buckets) == 4
    n = pack_buckets(({k: t[k] for k in names} for names in buckets), layout, flat)
    assert n == 4
    got, want = unpack(flat, layout), unpack(whole, layout)
    assert all(torch.equal(got[k], want[k]) for k in t)


def test_a_failed_bucket_still_consumes_the_rest_then_raises():
    t = _tensors()
    layout = plan_layout(t)
    consumed = []

    def buckets():
        for names in (["a"], ["b"], ["c", "n"]):
            consumed.append(names)
            yield {k: (t[k].reshape(-1)[:2] if k == "b" else t[k]) for k in names}

    with pytest.raises(RuntimeError):
        pack_buckets(buckets(), layout, torch.empty(total_bytes(layout), dtype=torch.uint8))
    assert consumed == [["a"], ["b"], ["c", "n"]]


def test_a_tensor_no_bucket_carried_is_refused():
    t = _tensors()
    layout = plan_layout(t)
    with pytest.raises(PackingError, match="came in no bucket"):
        pack_buckets([{"a": t["a"]}], layout, torch.empty(total_bytes(layout),
                                                           dtype=torch.uint8))
