"""GPU-only paths (skipped on CPU machines; run them on the device tool, see README)."""

from __future__ import annotations

import pytest
from conftest import assert_no_children
from test_sync_final_mode import test_final_mode_swap_tags_tokens_by_effect as _swap_by_effect

from tests.e2e.support.engine_loop import EngineLoop

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_gpu_weight_load_swap_tags_tokens_by_effect(tiny_model, tmp_path):
    """On CUDA the worker extension applies snapshots with ``model.load_weights`` (the CPU
    backend takes vLLM's in-place reload instead): same swap-under-load check by effect."""
    engine = EngineLoop(tiny_model)
    try:
        _swap_by_effect(tiny_model, tmp_path, "drain_prefill", engine)
    finally:
        engine.close()
    assert_no_children()
