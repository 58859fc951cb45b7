"""Versioned weight snapshots: named tensors + policy version + checksum, as one safetensors file.

A snapshot is written once by the learner and read by every producer's vLLM workers. Invariants:
- a snapshot file is complete or absent: it is written under a temporary name and renamed;
- the checksum (multi-threaded blake3 of the file bytes: 5x faster than blake2b on 2 cores, and
  it scales with cores; blake2b refs are still verified) travels separately, in the announce, so
  a torn or tampered file is refused before any weight is touched;
- names and shapes are checked against the model's manifest before loading, so a wrong-shape
  snapshot never reaches ``load_weights`` (a half-applied update is the failure to avoid).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import torch
from safetensors import safe_open
from safetensors.torch import save_file as st_save_file

_NAME = re.compile(r"^policy_v(\d+)\.safetensors$")


class SnapshotError(RuntimeError):
    """A snapshot that must not be loaded (bad checksum, wrong shapes, unknown names...)."""


@dataclass(frozen=True)
class SnapshotRef:
    """What travels in an announce: enough to find and verify a snapshot."""

    version: int
    uri: str
    checksum: str


def checksum_bytes(data: bytes | memoryview | mmap.mmap, algo: str = "blake3") -> str:
    if algo == "blake3":
        return "blake3:" + blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest(16)
    if algo == "blake2b":
        return "blake2b:" + hashlib.blake2b(data, digest_size=16).hexdigest()
    raise SnapshotError(f"unknown checksum algorithm {algo!r}")


def write_snapshot(tensors: dict[str, torch.Tensor], version: int, directory: str | Path
                   ) -> SnapshotRef:
    """Serialise ``tensors`` as snapshot ``version`` in ``directory`` (atomic rename)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    final = snapshot_path(d, version)
    tmp = d / f".{final.name}.{os.getpid()}.tmp"
    # Straight to the file (no bytes copy of the whole model), then hashed through a mapping.
    st_save_file(cpu, str(tmp), metadata={"policy_version": str(version)})
    with open(tmp, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
        checksum = checksum_bytes(m)
    os.replace(tmp, final)
    return SnapshotRef(version=version, uri=str(final), checksum=checksum)


# safetensors' names for the dtypes sync.packing can pack.
_ST_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64",
              "int64": "I64", "int32": "I32", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def snapshot_path(directory: str | Path, version: int) -> Path:
    return Path(directory) / f"policy_v{version}.safetensors"


def write_packed(flat: torch.Tensor, layout: Any, version: int, directory: str | Path
                 ) -> SnapshotRef:
    """Write a packed host buffer (``sync.packing``) as snapshot ``version``, atomically.

    The learner's capture packs the weights once, on its own device; this writes the file
    straight from that buffer (safetensors header from the layout, each tensor's bytes sliced
    out of it) and hashes the bytes as they are written, so the file costs one pass over the
    weights and no per-tensor CPU copies. Readable by ``read_snapshot`` like ``write_snapshot``'s.
    """
    if flat.device.type != "cpu" or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise SnapshotError(f"snapshot v{version}: write_packed needs a 1-D uint8 CPU buffer, "
                            f"got {flat.dtype} on {flat.device}")
    header: dict[str, Any] = {"__metadata__": {"policy_version": str(version)}}
    start = 0
    for e in layout:
        header[e.name] = {"dtype": _ST_DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [start, start + e.nbytes]}
        start += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = snapshot_path(d, version)
    tmp = d / f".{final.name}.{os.getpid()}.tmp"
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    data = memoryview(flat.numpy())
    try:
        with open(tmp, "wb") as fh:
            for chunk in (struct.pack("<Q", len(raw)), raw):
                fh.write(chunk)
                h.update(chunk)
            for e in layout:
                part = data[e.offset:e.offset + e.nbytes]
                fh.write(part)
                h.update(part)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return SnapshotRef(version=version, uri=str(final), checksum="blake3:" + h.hexdigest(16))


def read_snapshot(ref: SnapshotRef) -> dict[str, torch.Tensor]:
    """Read and verify a snapshot; raises SnapshotError on any mismatch.

    The file is mapped, not read into a bytes object: hashing and tensor creation then each touch
    the page cache once (the bytes copy cost as much as the hash for a 1 GB snapshot).
    """
    algo = ref.checksum.partition(":")[0]
    try:
        with open(ref.uri, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
            got = checksum_bytes(m, algo)
            if got != ref.checksum:
                raise SnapshotError(f"snapshot v{ref.version}: checksum mismatch for {ref.uri} "
                                    f"(expected {ref.checksum}, got {got}); refusing to load")
            try:  # the verified pages are still mapped, so this reads them from the page cache
                with safe_open(ref.uri, framework="pt") as st:
                    return {name: st.get_tensor(name) for name in st.keys()}  # noqa: SIM118
            except Exception as e:
                raise SnapshotError(f"snapshot v{ref.version}: not a valid safetensors file: "
                                    f"{e}") from None
    except (OSError, ValueError) as e:  # ValueError: mmap of an empty file
        raise SnapshotError(f"snapshot v{ref.version}: cannot read {ref.uri}: {e}") from None


def model_manifest(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a HF checkpoint's tensors, read from the safetensors headers only."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise SnapshotError(f"no *.safetensors in {model_dir}; cannot build a weight manifest")
    manifest: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                manifest[name] = tuple(fh.get_slice(name).get_shape())
    return manifest


def check_against_manifest(tensors: dict[str, torch.Tensor],
                           manifest: dict[str, tuple[int, ...]], version: int) -> None:
    """Refuse unknown names and wrong shapes (before anything is loaded)."""
    unknown = sorted(set(tensors) - set(manifest))
    if unknown:
        raise SnapshotError(f"snapshot v{version}: {len(unknown)} tensor(s) not in the model, "
                            f"e.g. {unknown[:3]}")
    bad = [(k, tuple(t.shape), manifest[k]) for k, t in tensors.items()
           if tuple(t.shape) != manifest[k]]
    if bad:
        name, got, want = bad[0]
        raise SnapshotError(f"snapshot v{version}: wrong shape for {name}: {got}, model has "
                            f"{want} ({len(bad)} mismatched tensor(s))")


def base_snapshot_files(model_dir: str | Path) -> list[str]:
    """The model's own weight files: version 0, the rollback target before any snapshot."""
    return [str(p) for p in sorted(Path(model_dir).glob("*.safetensors"))]


def drop_newer(directory: str | Path, version: int) -> list[Path]:
    """Delete the snapshot files of versions above ``version``; returns what was deleted. A
    learner restarted from an older checkpoint publishes those numbers again with other
    weights; the dead learner's files would meanwhile outrank the versions it writes now, and
    ``prune_snapshots`` would delete each of those as soon as it is written."""
    d = Path(directory)
    if not d.is_dir():
        return []
    doomed = [p for p in d.iterdir() if (m := _NAME.match(p.name)) and int(m.group(1)) > version]
    for p in doomed:
        p.unlink(missing_ok=True)
    return doomed


def prune_snapshots(directory: str | Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest snapshot files; returns what was deleted."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = sorted((int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name)))
    doomed = [p for _, p in found[:-keep]] if keep > 0 else [p for _, p in found]
    for p in doomed:
        p.unlink(missing_ok=True)
    return doomed

