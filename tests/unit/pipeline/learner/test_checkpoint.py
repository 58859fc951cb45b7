"""Checkpoints: lossless round trip (safetensors files written by several threads), atomicity
under a failed save (an injected ENOSPC, and a real full tmpfs where this machine can mount one),
pruning, a rewrite of the same step, unreadable files, the free-space check."""

from __future__ import annotations

import os
import shutil
import uuid
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
from tests.small_fs import small_filesystem


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


def _tied_and_odd() -> dict:
    """Shapes a trainer state has: tied weights, 0-dim and empty tensors, bf16, int keys,
    tuples, None, non-finite floats, a non-contiguous tensor."""
    w = torch.randn(6, 4)
    return {"model": {"embed": w, "lm_head": w, "half": torch.randn(3, 5).to(torch.bfloat16),
                      "t": torch.randn(4, 6).t(), "empty": torch.zeros(0, 3)},
            "optimizer": {"state": {0: {"step": torch.tensor(3.0)}, 7: {}},
                          "param_groups": [{"betas": (0.9, 0.99), "foreach": None,
                                            "eps": float("inf"), "params": [0, 7]}]},
            "flag": True, "n": 3, "x": 0.1}


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


def test_round_trip_keeps_structure_types_and_tied_tensors(tmp_path):
    path = save_checkpoint(tmp_path, _state(1), _tied_and_odd(), b"")
    _s, tensors, _b = load_checkpoint(path)
    live = _tied_and_odd()
    assert tensors["model"]["lm_head"] is tensors["model"]["embed"]  # stored once
    assert tensors["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert set(tensors["optimizer"]["state"]) == {0, 7}  # int keys stay int
    assert tensors["optimizer"]["param_groups"][0]["eps"] == float("inf")
    assert tensors["model"]["half"].dtype == torch.bfloat16
    assert tensors["model"]["empty"].shape == (0, 3)
    assert tensors["optimizer"]["state"][0]["step"].shape == ()
    assert (tensors["flag"], tensors["n"], tensors["x"]) == (True, 3, 0.1)
    assert tensors["model"]["t"].shape == live["model"]["t"].shape


def test_a_big_state_spreads_over_files_written_in_parallel(tmp_path, monkeypatch):
    monkeypatch.setattr(ck, "MIN_SHARD_BYTES", 1024)
    big = {f"w{i}": torch.randn(64, 64) for i in range(16)}  # 256 KiB
    path = save_checkpoint(tmp_path, _state(1), {"model": big}, b"", threads=4)
    files = sorted(p.name for p in path.glob("tensors-*.safetensors"))
    assert len(files) == 4  # total / threads each
    _assert_same({"model": big}, load_checkpoint(path)[1])


@pytest.mark.parametrize("where", ["save_file", "write_bytes", "os.replace"])
def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch, where):
    """An injected ENOSPC (a raising stand-in for the write) at each stage of a save."""
    prev = save_checkpoint(tmp_path, _state(1), _tensors(1), b"one")

    def boom(*_a, **_k):
        raise OSError(28, "No space left on device")

    if where == "save_file":
        monkeypatch.setattr(ck, "save_file", boom)
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
    monkeypatch.setattr(ck, "save_file", lambda *a, **k: (_ for _ in ()).throw(OSError("x")))
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


def _orphan_beside(tmp_path, named: int, orphan: str) -> None:
    """checkpoints/ as a writer killed between its rename and the switch of LATEST leaves it:
    ``orphan`` complete on disk, LATEST still naming step ``named``."""
    save_checkpoint(tmp_path, _state(named), _tensors(named), b"", keep=3)
    path = save_checkpoint(tmp_path, _state(99), _tensors(99), b"", keep=3)
    path.rename(path.with_name(orphan))
    ck._switch_latest(tmp_path / "checkpoints", f"step_{named}")


@pytest.mark.parametrize("orphan", ["step_10", "step_8-1"])
def test_an_orphan_is_removed_and_the_resumed_checkpoint_kept(tmp_path, orphan):
    """The run resumed from step_8 (LATEST) writes step_9 with keep 2: it keeps step_9 and
    step_8, and removes the orphan (a later step, or a rewrite of step 8 never named), which
    holds another run's weights and took step_8's place as the newest."""
    _orphan_beside(tmp_path, 8, orphan)
    assert latest_checkpoint(tmp_path).name == "step_8"
    save_checkpoint(tmp_path, _state(9), _tensors(9), b"", keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert names == ["step_8", "step_9"]
    assert load_checkpoint(tmp_path / "checkpoints" / "step_8")[0].step == 8


def test_resaving_same_step_replaces_it(tmp_path):
    save_checkpoint(tmp_path, _state(4), _tensors(4), b"old")
    path = save_checkpoint(tmp_path, _state(4), _tensors(4), b"new")
    assert latest_checkpoint(tmp_path) == path and load_checkpoint(path)[2] == b"new"
    assert [p.name for p in (tmp_path / "checkpoints").glob("step_*")] == [path.name]
    again = save_checkpoint(tmp_path, _state(4), _tensors(4), b"third")
    assert load_checkpoint(latest_checkpoint(tmp_path))[2] == b"third"
    assert [p.name for p in (tmp_path / "checkpoints").glob("step_*")] == [again.name]


def test_a_rewrite_of_the_named_step_failing_keeps_it_named(tmp_path, monkeypatch):
    """The final checkpoint after a periodic one at the same step: the directory LATEST names is
    never removed before LATEST names the new one, so a failure (or a kill) in between leaves
    the old one named and loadable."""
    old = save_checkpoint(tmp_path, _state(4), _tensors(4), b"old")
    real = os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".tmp_step_"):  # the new directory's rename fails
            raise OSError(5, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(ck.os, "replace", replace)
    with pytest.raises(CheckpointError, match=str(old)):
        save_checkpoint(tmp_path, _state(4), _tensors(4), b"new")
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == old and load_checkpoint(old)[2] == b"old"


def test_latest_is_fsynced_before_its_rename(tmp_path, monkeypatch):
    synced: list[str] = []
    order: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def replace(src, dst):
        if Path(dst).name == "LATEST":
            order.append(f"replace after {len(synced)} fsyncs, "
                         f"tmp synced: {str(src) in synced}")
        return real_replace(src, dst)

    monkeypatch.setattr(ck.os, "fsync", fsync)
    monkeypatch.setattr(ck.os, "replace", replace)
    save_checkpoint(tmp_path, _state(1), _tensors(1), b"")
    assert order and order[0].endswith("tmp synced: True")


@pytest.mark.parametrize("damage", ["tensors", "truncated", "trainer.json", "state.json",
                                    "buffer.msgpack", "keys"])
def test_unreadable_checkpoint_raises(tmp_path, damage):
    path = save_checkpoint(tmp_path, _state(1), _tensors(1), b"buf")
    tensors_file = next(path.glob("tensors-*.safetensors"))
    if damage == "tensors":
        tensors_file.write_bytes(b"not a safetensors file")
    elif damage == "truncated":
        data = tensors_file.read_bytes()
        tensors_file.write_bytes(data[: len(data) // 2])
    elif damage == "trainer.json":
        (path / "trainer.json").write_text('{"files": ["nope.safetensors"], "tree": {}}')
    elif damage == "state.json":
        (path / "state.json").write_text("{truncated")
    elif damage == "buffer.msgpack":
        (path / "buffer.msgpack").unlink()
    else:  # a state.json from an unknown version
        (path / "state.json").write_text('{"step": 1, "bogus": 2}')
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(path)


def test_an_older_trainer_pt_checkpoint_loads_and_pickles_are_refused(tmp_path):
    """Checkpoints written before the safetensors layout still load (weights_only=True), and
    a trainer.pt holding arbitrary objects does not."""
    path = save_checkpoint(tmp_path, _state(1), _tensors(1), b"")
    for f in [*path.glob("tensors-*"), path / "trainer.json"]:
        f.unlink()
    torch.save(_tensors(1), path / "trainer.pt")
    _assert_same(_tensors(1), load_checkpoint(path)[1])
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


# ------------------------------------------------------------------ a real full disk
@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs mounted for the test (root only; skipped where mounting is refused)."""
    with small_filesystem(tmp_path / f"full-{uuid.uuid4().hex[:6]}", 2) as mnt:
        yield mnt


def test_a_real_full_disk_keeps_the_previous_checkpoint(small_tmpfs):
    """ENOSPC from the filesystem itself: a 1.2 MB checkpoint fits a 2 MiB tmpfs once beside
    nothing, and the next one (beside the kept one) does not."""
    run = small_tmpfs / "run"
    state = {"model": {"w": torch.randn(300_000)}}  # 1.2 MB
    first = save_checkpoint(run, _state(1), state, b"one", keep=1)
    with pytest.raises(CheckpointError, match=r"step 2.*No space left.*step_1 is intact"):
        save_checkpoint(run, _state(2), {"model": {"w": torch.randn(300_000) + 1}}, b"two",
                        keep=1)
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step_1"]  # partial dir gone
    assert latest_checkpoint(run) == first
    _s, tensors, buf = load_checkpoint(first)
    assert torch.equal(tensors["model"]["w"], state["model"]["w"]) and buf == b"one"


# ------------------------------------------------------------------ free space
def test_space_shortfall_names_bytes_run_dir_and_the_option(tmp_path):
    from pipeline.learner.disk import space_shortfall

    assert space_shortfall(tmp_path, 100, keep=2, free=300) is None
    why = space_shortfall(tmp_path, 100, keep=2, free=299)
    assert "\n" not in why
    assert all(s in why for s in ("300 bytes", "299 bytes", str(tmp_path),
                                  "train.keep_checkpoints 2"))
    # Checkpoints already there count as written (a resumed run).
    save_checkpoint(tmp_path, _state(1), _tensors(1), b"")
    have = sum(f.stat().st_size for f in (tmp_path / "checkpoints" / "step_1").rglob("*"))
    assert space_shortfall(tmp_path, 10_000, keep=2, free=30_000 - have) is None
    assert space_shortfall(tmp_path, 10_000, keep=2, free=30_000 - have - 1) is not None


def test_a_run_that_writes_only_its_final_checkpoint_needs_room_for_one(tmp_path, monkeypatch):
    from pipeline.config import load_config
    from pipeline.learner.disk import check_run_space, space_shortfall

    assert space_shortfall(tmp_path, 100, keep=2, free=100, final_only=True) is None
    why = space_shortfall(tmp_path, 100, keep=2, free=99, final_only=True)
    assert "final checkpoint needs 100 bytes" in why and "\n" not in why

    def cfg(**over):
        return load_config(overrides={"run_dir": str(tmp_path), "data.path": "arithmetic:10",
                                      **over})

    import json

    import pipeline.learner.disk as disk
    from pipeline.memory import model_parameters

    hf = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 1000}
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(hf))
    each = disk.estimate_checkpoint_bytes(model_parameters(hf), model_parameters(hf))
    monkeypatch.setattr(disk, "disk_free", lambda _p: int(1.5 * each))  # one fits, not two
    assert check_run_space(cfg(), str(model)) is None
    for over in ({"train.checkpoint_every": 1}, {"max_producers": 2}):
        short = check_run_space(cfg(**over), str(model))
        assert short is not None and "train.keep_checkpoints" in short, over


def test_the_estimate_from_the_config_is_the_checkpoint_written(tiny_model, tmp_path):
    """The preflight's size of a checkpoint, from config.json alone, against the bytes of the
    state the trainer checkpoints after a step (fp32 weights and AdamW's two moments)."""
    import json

    from transformers import AutoModelForCausalLM

    from pipeline.learner.disk import dir_bytes, estimate_checkpoint_bytes, trainable_parameters
    from pipeline.memory import model_parameters

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # AdamW's state exists, as after the first training step
    path = save_checkpoint(tmp_path, _state(1), {"model": model.state_dict(),
                                                 "optimizer": opt.state_dict()}, b"")
    hf = json.loads((tiny_model / "config.json").read_text())
    params = model_parameters(hf)
    est = estimate_checkpoint_bytes(params, trainable_parameters(hf, params, False, 0))
    assert abs(est - dir_bytes(path)) / dir_bytes(path) < 0.05


def test_a_run_whose_disk_cannot_hold_its_checkpoints_is_refused_first(small_tmpfs, tiny_model,
                                                                        tmp_path):
    """The launcher's check before any process starts (``preflight``): keep + 1 checkpoints of
    the tiny model (about 4.7 MB each) do not fit a 2 MiB filesystem; one line names the bytes
    needed and free, run_dir and train.keep_checkpoints. On a roomy disk: no refusal."""
    from pipeline.config import load_config
    from pipeline.learner.disk import check_run_space

    def cfg(run_dir, keep):
        return load_config(overrides={"model.path": str(tiny_model), "data.path": "arithmetic:10",
                                      "run_dir": str(run_dir), "train.keep_checkpoints": keep,
                                      "train.checkpoint_every": 1})

    why = check_run_space(cfg(small_tmpfs / "run", 2), str(tiny_model))
    assert why is not None and "\n" not in why
    assert f"run_dir {small_tmpfs / 'run'}" in why and "train.keep_checkpoints 2" in why
    free = shutil.disk_usage(small_tmpfs).free
    assert f"but {free} bytes are free" in why
    assert check_run_space(cfg(tmp_path / "run", 1), str(tiny_model)) is None
