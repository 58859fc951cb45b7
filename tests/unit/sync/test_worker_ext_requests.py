"""``sync_scheduled_requests`` against stand-in model runners (no vLLM): it must read both runner
layouts vLLM 0.25 and 0.32 ship, and fail loudly on any other rather than report no request
started (the drain would then resubmit prefills that are under way, and never wait for them)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sync.worker_ext import WeightSyncExtension


def _worker(runner) -> WeightSyncExtension:
    w = WeightSyncExtension()
    w.model_runner = runner  # type: ignore[attr-defined]
    return w


def test_v1_runner_requests_with_fake_runner():
    runner = SimpleNamespace(requests={"a-1f2e3d4c": object(), "b-0a1b2c3d": object()})
    assert sorted(_worker(runner).sync_scheduled_requests()) == ["a-1f2e3d4c", "b-0a1b2c3d"]


def test_v2_runner_req_states_with_fake_runner():
    runner = SimpleNamespace(req_states=SimpleNamespace(req_id_to_index={"a-1f2e3d4c": 0}))
    assert _worker(runner).sync_scheduled_requests() == ["a-1f2e3d4c"]


def test_unknown_runner_fails_with_fake_runner():
    with pytest.raises(RuntimeError, match="cannot list the requests"):
        _worker(SimpleNamespace()).sync_scheduled_requests()
