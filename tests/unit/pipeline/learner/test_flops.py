"""Model FLOPs and device peaks of the MFU metric (pure arithmetic)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline.learner.flops import ModelShape, peak_flops, train_flops

QWEN25_3B = SimpleNamespace(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
                            num_key_value_heads=2, intermediate_size=11008, vocab_size=151936)


def test_body_params_match_the_published_size_of_qwen25_3b():
    shape = ModelShape.from_config(QWEN25_3B)
    assert shape.head_dim == 128
    # Qwen2.5-3B: 3.09e9 parameters, of which the tied embedding is 2048 x 151936 = 0.31e9
    # (biases and norms, under 1e6, are not matmuls).
    assert shape.body_params == pytest.approx(3.09e9 - 2048 * 151936, rel=0.01)


def test_train_flops_count_body_head_and_causal_attention():
    shape = ModelShape(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16,
                       vocab=100)
    body = 2 * (8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16)
    assert shape.body_params == body
    attention = 6 * 2 * 8 * (3 * 4 + 5 * 6)  # sequences of 3 and 5 tokens
    assert train_flops(shape, [3, 5], head_positions=4) == 6 * body * 8 + 6 * 8 * 100 * 4 \
        + attention


def test_peak_by_device_name():
    assert peak_flops("NVIDIA H200") == peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("cpu") is None
