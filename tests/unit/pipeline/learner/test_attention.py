"""Varlen attention of packed rows: boundaries from position ids, and the CUDA kernel against
the per-sequence SDPA it replaces (GPU only)."""

from __future__ import annotations

import pytest
import torch

from pipeline.learner.attention import (
    flash_varlen_attention,
    per_sequence_attention,
    varlen_available,
    varlen_kwargs,
)


def test_boundaries_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    kw = varlen_kwargs(pos)
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 5, 9] and kw["max_length_q"] == 4
    assert kw["cu_seq_lens_k"] is kw["cu_seq_lens_q"] and kw["cu_seq_lens_q"].dtype == torch.int32


def test_per_sequence_attention_never_crosses_a_boundary():
    torch.manual_seed(0)
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    cu = torch.tensor([0, 3, 9], dtype=torch.int32)
    out = per_sequence_attention(q, k, v, cu, None)
    alone = per_sequence_attention(q[3:], k[3:], v[3:], torch.tensor([0, 6]), None)
    torch.testing.assert_close(out[3:], alone)


@pytest.mark.gpu
@pytest.mark.skipif(not varlen_available(), reason="needs CUDA and torch's varlen attention")
def test_flash_varlen_equals_per_sequence_sdpa():
    torch.manual_seed(0)
    q = torch.randn(300, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(300, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 100, 137, 300], device="cuda", dtype=torch.int32)
    torch.testing.assert_close(flash_varlen_attention(q, k, v, cu, 163, 0.125),
                               per_sequence_attention(q, k, v, cu, 0.125), atol=2e-2, rtol=2e-2)
