"""Checkpoints: lossless round trip, atomicity under a failed save, pruning, unreadable files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pipeline.learner import checkpoint as ck
from pipeline.learner.checkpoint import (
    CheckpointError,
    LearnerState,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)


def _state(step: int) -> LearnerState:
    return LearnerState(step=step, version=step - 1, received={"p0": 3 * step, "p1": 2},
                        cursors={"p0": 7 * step}, counters={"skipped_nonfinite": 1.0},
                        first_reward=0.25)


def _tensors(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(4, 3, generator=g), "b": torch.arange(3)},
            "optimizer": {"state": {0: {"exp_avg": torch.ones(2) * step}},
                          "param_groups": [{"lr": 1e-3, "params": [0]}]},
            "rng": torch.get_rng_state()}


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_round_trip_is_lossless(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    path = save_checkpoint(tmp_path, _state(3), _tensors(3), b"\x00buffer\xff")
    assert path == tmp_path / "checkpoints" / "step_3"
    assert latest_checkpoint(tmp_path) == path
    state, tensors, buf = load_checkpoint(path)
    assert state == _state(3)
    _assert_same(_tensors(3), tensors)
    assert buf == b"\x00buffer\xff"
    # No temporary files left behind.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["LATEST", "step_3"]


@pytest.mark.parametrize("where", ["torch.save", "write_bytes", "os.replace"])
def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch, where):
    prev = save_checkpoint(tmp_path, _state(1), _tensors(1), b"one")

    def boom(*_a, **_k):
        raise OSError(28, "No space left on device")

    if where == "torch.save":
        monkeypatch.setattr(ck.torch, "save", boom)
    elif where == "write_bytes":
        monkeypatch.setattr(Path, "write_bytes", boom)
    else:  # the step_N rename itself fails
        monkeypatch.setattr(ck.os, "replace", boom)
    with pytest.raises(CheckpointError) as ei:
        save_checkpoint(tmp_path, _state(2), _tensors(2), b"two")
    msg = str(ei.value)
    assert "step 2" in msg and "No space left" in msg
    assert str(prev) in msg and "intact" in msg
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == prev
    state, tensors, buf = load_checkpoint(prev)
    assert state == _state(1) and buf == b"one"
    _assert_same(_tensors(1), tensors)
    root = tmp_path / "checkpoints"
    assert not any(p.name.startswith(".tmp") for p in root.iterdir())
    assert not (root / "step_2").exists()
    # The next save works.
    assert save_checkpoint(tmp_path, _state(2), _tensors(2), b"two") == root / "step_2"
    assert latest_checkpoint(tmp_path) == root / "step_2"


def test_failure_replacing_latest_keeps_previous_named(tmp_path, monkeypatch):
    """The checkpoint dir was renamed but LATEST could not be replaced: LATEST still names a
    complete, loadable checkpoint."""
    prev = save_checkpoint(tmp_path, _state(1), _tensors(1), b"one")
    real = os.replace

    def replace(src, dst):
        if Path(dst).name == "LATEST":
            raise OSError(5, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(ck.os, "replace", replace)
    with pytest.raises(CheckpointError, match=str(prev)):
        save_checkpoint(tmp_path, _state(2), _tensors(2), b"two")
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == prev
    assert load_checkpoint(prev)[0].step == 1


def test_first_save_failure_says_none(tmp_path, monkeypatch):
    monkeypatch.setattr(ck.torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("x")))
    with pytest.raises(CheckpointError, match=r"\(none\)"):
        save_checkpoint(tmp_path, _state(1), _tensors(1), b"")
    assert latest_checkpoint(tmp_path) is None


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_keep_prunes_oldest(tmp_path, keep):
    for step in (1, 2, 3, 10, 11):  # numeric, not lexicographic, order
        save_checkpoint(tmp_path, _state(step), _tensors(step), b"", keep=keep)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert names == sorted(f"step_{s}" for s in (1, 2, 3, 10, 11)[-keep:])
    assert latest_checkpoint(tmp_path).name == "step_11"


def test_resaving_same_step_replaces_it(tmp_path):
    save_checkpoint(tmp_path, _state(4), _tensors(4), b"old")
    path = save_checkpoint(tmp_path, _state(4), _tensors(4), b"new")
    assert load_checkpoint(path)[2] == b"new"


@pytest.mark.parametrize("damage", ["trainer.pt", "truncated", "state.json", "buffer.msgpack",
                                    "keys"])
def test_unreadable_checkpoint_raises(tmp_path, damage):
    path = save_checkpoint(tmp_path, _state(1), _tensors(1), b"buf")
    if damage == "trainer.pt":
        (path / "trainer.pt").write_bytes(b"not a torch file")
    elif damage == "truncated":
        data = (path / "trainer.pt").read_bytes()
        (path / "trainer.pt").write_bytes(data[: len(data) // 2])
    elif damage == "state.json":
        (path / "state.json").write_text("{truncated")
    elif damage == "buffer.msgpack":
        (path / "buffer.msgpack").unlink()
    else:  # a state.json from an unknown version
        (path / "state.json").write_text('{"step": 1, "bogus": 2}')
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(path)


def test_pickled_objects_are_refused(tmp_path):
    """weights_only=True: a trainer.pt holding arbitrary objects does not load."""
    path = save_checkpoint(tmp_path, _state(1), _tensors(1), b"")
    torch.save({"model": _Evil()}, path / "trainer.pt")
    with pytest.raises(CheckpointError):
        load_checkpoint(path)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_latest_ignores_dangling_pointer(tmp_path):
    save_checkpoint(tmp_path, _state(1), _tensors(1), b"")
    (tmp_path / "checkpoints" / "LATEST").write_text("step_99")
    assert latest_checkpoint(tmp_path) is None
