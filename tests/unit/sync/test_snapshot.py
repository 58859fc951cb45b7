"""Snapshots: round trip, checksum and manifest refusals, atomic writes, pruning (pure, no vLLM)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sync.snapshot import (
    SnapshotError,
    SnapshotRef,
    check_against_manifest,
    model_manifest,
    prune_snapshots,
    read_snapshot,
    write_snapshot,
)


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
            "model.norm.weight": torch.randn(8, generator=g),
            "lm_head.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16)}


def test_round_trip_keeps_names_dtypes_and_values(tmp_path):
    src = _tensors()
    ref = write_snapshot(src, 3, tmp_path)
    assert ref.version == 3 and Path(ref.uri).name == "policy_v3.safetensors"
    assert ref.checksum.startswith("blake3:")
    got = read_snapshot(ref)
    assert set(got) == set(src)
    for k, t in src.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t)


def test_bad_checksum_is_refused(tmp_path):
    ref = write_snapshot(_tensors(), 1, tmp_path)
    bad = SnapshotRef(ref.version, ref.uri, "blake2b:" + "0" * 32)
    with pytest.raises(SnapshotError, match="checksum mismatch"):
        read_snapshot(bad)


def test_torn_file_is_refused_by_checksum(tmp_path):
    ref = write_snapshot(_tensors(), 1, tmp_path)
    data = Path(ref.uri).read_bytes()
    Path(ref.uri).write_bytes(data[: len(data) // 2])
    with pytest.raises(SnapshotError, match="checksum mismatch"):
        read_snapshot(ref)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(SnapshotError, match="cannot read"):
        read_snapshot(SnapshotRef(1, str(tmp_path / "nope.safetensors"), "blake2b:00"))


def test_manifest_refuses_wrong_shape_and_unknown_name(tmp_path):
    src = _tensors()
    save_file({k: v.contiguous() for k, v in src.items()}, str(tmp_path / "model.safetensors"))
    manifest = model_manifest(tmp_path)
    assert manifest["lm_head.weight"] == (16, 8)
    check_against_manifest(src, manifest, 1)  # the model's own weights pass

    wrong = dict(src, **{"lm_head.weight": torch.zeros(16, 9)})
    with pytest.raises(SnapshotError, match=r"wrong shape for lm_head\.weight"):
        check_against_manifest(wrong, manifest, 2)

    unknown = dict(src, **{"model.layers.99.mlp.up_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(SnapshotError, match="not in the model"):
        check_against_manifest(unknown, manifest, 3)


def test_manifest_of_dir_without_weights_is_an_error(tmp_path):
    with pytest.raises(SnapshotError, match=r"no \*\.safetensors"):
        model_manifest(tmp_path)


def test_write_is_atomic_no_partial_file_visible(tmp_path, monkeypatch):
    """While the bytes are being written, neither the final name nor a partial file exists."""
    seen: list[list[str]] = []
    real_replace = os.replace

    def spying_replace(src, dst):
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spying_replace)
    ref = write_snapshot(_tensors(), 7, tmp_path)
    # Just before the rename only the hidden temporary file exists.
    assert len(seen) == 1 and all(n.startswith(".") and n.endswith(".tmp") for n in seen[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy_v7.safetensors"]
    read_snapshot(ref)


def test_reader_never_sees_a_partial_snapshot_while_rewritten(tmp_path):
    """A reader polling the final name sees a complete file or nothing, never a torn one."""
    big = {"w": torch.randn(512, 512)}
    refs = [write_snapshot(big, 1, tmp_path)]
    stop = threading.Event()
    errors: list[str] = []

    def reader() -> None:
        path = Path(refs[0].uri)
        size = path.stat().st_size
        while not stop.is_set():
            if path.exists() and path.stat().st_size != size:
                errors.append(f"partial file of {path.stat().st_size} bytes")

    th = threading.Thread(target=reader)
    th.start()
    try:
        for _ in range(10):
            refs.append(write_snapshot(big, 1, tmp_path))
    finally:
        stop.set()
        th.join()
    assert not errors
    assert read_snapshot(refs[-1])["w"].shape == (512, 512)


def test_prune_keeps_newest_n(tmp_path):
    for v in (1, 2, 10, 3, 11):
        write_snapshot({"w": torch.zeros(1)}, v, tmp_path)
    (tmp_path / "notes.txt").write_text("not a snapshot")
    deleted = prune_snapshots(tmp_path, keep=2)
    # Numeric (not lexical) order: v10 and v11 are the newest.
    assert sorted(p.name for p in deleted) == ["policy_v1.safetensors", "policy_v2.safetensors",
                                               "policy_v3.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "notes.txt", "policy_v10.safetensors", "policy_v11.safetensors"]
    assert prune_snapshots(tmp_path, keep=0) and \
        [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert prune_snapshots(tmp_path / "absent", keep=1) == []


def test_blake2b_refs_from_older_runs_still_verify(tmp_path):
    """A ref written with the old algorithm is still checked (and refused when it differs)."""
    from sync.snapshot import checksum_bytes

    ref = write_snapshot({"w": torch.ones(4, 4)}, 1, tmp_path)
    old = SnapshotRef(1, ref.uri, checksum_bytes(Path(ref.uri).read_bytes(), "blake2b"))
    assert torch.equal(read_snapshot(old)["w"], torch.ones(4, 4))
    with pytest.raises(SnapshotError, match="checksum mismatch"):
        read_snapshot(SnapshotRef(1, ref.uri, "blake2b:" + "0" * 32))
    with pytest.raises(SnapshotError, match="unknown checksum"):
        read_snapshot(SnapshotRef(1, ref.uri, "md5:abc"))


def test_a_restarted_learner_drops_the_dead_ones_newer_files(tmp_path):
    """Restored at v3 while the killed learner had written up to v6: v6 and v5 would otherwise
    be 'the newest' and prune every version the restored learner writes (v3, v4 ...)."""
    from sync.snapshot import drop_newer, prune_snapshots

    for v in (2, 3, 5, 6):
        (tmp_path / f"policy_v{v}.safetensors").write_bytes(b"x")
    assert sorted(p.name for p in drop_newer(tmp_path, 3)) == ["policy_v5.safetensors",
                                                               "policy_v6.safetensors"]
    (tmp_path / "policy_v4.safetensors").write_bytes(b"y")  # the restored learner's next
    prune_snapshots(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy_v3.safetensors",
                                                          "policy_v4.safetensors"]
