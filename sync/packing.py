"""Packed weights: every tensor of a snapshot in one flat byte buffer, plus its layout.

The GPU routes (``ipc``, ``nccl``) move one contiguous buffer per version instead of ~300
tensors: one CUDA IPC handle to export and open, one NCCL broadcast to post. The layout (name,
dtype, shape, byte offset of each tensor) travels as plain msgpack-safe lists, so it can ride in
the learner's Announce; it is validated on the way in (``layout_from_wire``), and unpacking only
takes views of the buffer, never parses anything else.

Also the explicit, msgpack-safe form of a CUDA IPC handle (``ipc_export`` / ``ipc_import``): the
fields torch's ``reduce_tensor`` produces for a CUDA storage, as bytes/ints/str/bool, rebuilt
with ``rebuild_cuda_tensor`` on the receiving side. Nothing is pickled.

Invariants: offsets are ``ALIGN``-byte aligned (any dtype view is legal); the buffer holds
exactly ``total_bytes(layout)`` bytes; names are unique.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 256
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
           "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}
_IPC_FIELDS = {"handle": bytes, "storage_size_bytes": int, "storage_offset_bytes": int,
               "ref_counter_handle": bytes, "ref_counter_offset": int,
               "event_handle": (bytes, type(None)), "event_sync_required": bool,
               "nbytes": int, "gpu_uuid": str}


class PackingError(ValueError):
    """A layout or handle that must not be used (the message says which field is wrong)."""


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        n = _DTYPES[self.dtype].itemsize
        for s in self.shape:
            n *= s
        return n


Layout = tuple[Entry, ...]


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise PackingError(f"dtype {dtype} cannot be packed (supported: {sorted(_DTYPES)})")
    return name


def plan_layout(tensors: dict[str, torch.Tensor]) -> Layout:
    """Aligned offsets for ``tensors`` in insertion order."""
    return plan_layout_of({name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()})


def plan_layout_of(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> Layout:
    """Aligned offsets for tensors known by (dtype, shape) only, in insertion order: a sharded
    learner plans the whole version before it gathers any of it."""
    out, off = [], 0
    for name, (dtype, shape) in specs.items():
        e = Entry(name, dtype_name(dtype), tuple(int(s) for s in shape), off)
        out.append(e)
        off += -(-e.nbytes // ALIGN) * ALIGN
    return tuple(out)


def plan_buckets(layout: Layout, bucket_bytes: int) -> list[list[str]]:
    """``layout``'s names in order, cut into runs of at most ``bucket_bytes`` each (a tensor
    larger than that is a bucket of its own). A sharded learner gathers one bucket at a time,
    so no rank ever holds more than a bucket of gathered weights beside its own shards."""
    out: list[list[str]] = []
    size = 0
    for e in layout:
        if not out or (size + e.nbytes > bucket_bytes and out[-1]):
            out.append([])
            size = 0
        out[-1].append(e.name)
        size += e.nbytes
    return out


def total_bytes(layout: Layout) -> int:
    if not layout:
        return 0
    last = layout[-1]
    return last.offset + -(-last.nbytes // ALIGN) * ALIGN


def pack(tensors: dict[str, torch.Tensor], layout: Layout, device: torch.device | str
         ) -> torch.Tensor:
    """A new uint8 buffer on ``device`` holding ``tensors`` (copied) at the layout's offsets."""
    flat = torch.empty(total_bytes(layout), dtype=torch.uint8, device=device)
    for view, e in zip(unpack(flat, layout).values(), layout, strict=True):
        view.copy_(tensors[e.name].detach().reshape(e.shape))
    return flat


def unpack(flat: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Views of ``flat`` (no copy), one per layout entry."""
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < total_bytes(layout):
        raise PackingError(f"packed buffer of {flat.numel()} bytes ({flat.dtype}) cannot hold "
                           f"a layout of {total_bytes(layout)} bytes")
    return {e.name: flat[e.offset:e.offset + e.nbytes].view(_DTYPES[e.dtype]).view(e.shape)
            for e in layout}


def layout_to_wire(layout: Layout) -> list[list[Any]]:
    return [[e.name, e.dtype, list(e.shape), e.offset] for e in layout]


def layout_from_wire(data: Any) -> Layout:
    """Validate a layout received over the wire (types, dtypes, alignment, no overlap)."""
    if not isinstance(data, list):
        raise PackingError(f"layout: expected a list, got {type(data).__name__}")
    out: list[Entry] = []
    seen: set[str] = set()
    end = 0
    for i, row in enumerate(data):
        if not (isinstance(row, list) and len(row) == 4):
            raise PackingError(f"layout[{i}]: expected [name, dtype, shape, offset]")
        name, dtype, shape, offset = row
        if not isinstance(name, str) or not name or name in seen:
            raise PackingError(f"layout[{i}]: bad or repeated name {name!r}")
        if dtype not in _DTYPES:
            raise PackingError(f"layout[{i}] ({name}): unknown dtype {dtype!r}")
        if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
            raise PackingError(f"layout[{i}] ({name}): bad shape {shape!r}")
        if type(offset) is not int or offset % ALIGN or offset < end:
            raise PackingError(f"layout[{i}] ({name}): offset {offset!r} is unaligned or "
                               f"overlaps the previous tensor")
        e = Entry(name, dtype, tuple(shape), offset)
        seen.add(name)
        end = offset + e.nbytes
        out.append(e)
    return tuple(out)


def check_layout(layout: Layout, manifest: dict[str, tuple[int, ...]], version: int) -> None:
    """Refuse names the model does not have and wrong shapes (before anything is received)."""
    unknown = [e.name for e in layout if e.name not in manifest]
    if unknown:
        raise PackingError(f"v{version}: {len(unknown)} packed tensor(s) not in the model, "
                           f"e.g. {unknown[:3]}")
    bad = [e for e in layout if e.shape != tuple(manifest[e.name])]
    if bad:
        raise PackingError(f"v{version}: wrong shape for {bad[0].name}: {bad[0].shape}, model "
                           f"has {tuple(manifest[bad[0].name])}")


# ------------------------------------------------------------------ CUDA IPC, msgpack-safe

def ipc_export(flat: torch.Tensor, gpu_uuid: str) -> dict[str, Any]:
    """The CUDA IPC handle of ``flat`` (a whole uint8 buffer) as plain fields."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not flat.is_cuda:
        # A ZeRO-3 learner's gathered state dict is on the CPU (DeepSpeed copies each gathered
        # layer to host memory), so a buffer packed next to it was too.
        raise PackingError(f"ipc_export needs a CUDA buffer; this one is on {flat.device}")
    if flat.storage_offset() != 0 or not flat.is_contiguous():
        raise PackingError(f"ipc_export needs a whole contiguous buffer (storage offset "
                           f"{flat.storage_offset()}, contiguous {flat.is_contiguous()})")
    _rebuild, args = reduce_tensor(flat)
    (_cls, _size, _stride, _toff, _scls, _dtype, _dev, handle, size_b, off_b, _rg,
     rc_handle, rc_off, ev_handle, ev_sync) = args
    return {"handle": bytes(handle), "storage_size_bytes": int(size_b),
            "storage_offset_bytes": int(off_b), "ref_counter_handle": bytes(rc_handle),
            "ref_counter_offset": int(rc_off),
            "event_handle": None if ev_handle is None else bytes(ev_handle),
            "event_sync_required": bool(ev_sync), "nbytes": int(flat.numel()),
            "gpu_uuid": gpu_uuid}


def check_ipc_fields(fields: Any) -> dict[str, Any]:
    """Exactly the fields ``ipc_export`` writes, with their types (else PackingError)."""
    if not isinstance(fields, dict) or set(fields) != set(_IPC_FIELDS):
        got = sorted(fields) if isinstance(fields, dict) else type(fields).__name__
        raise PackingError(f"ipc handle: expected fields {sorted(_IPC_FIELDS)}, got {got}")
    for k, tp in _IPC_FIELDS.items():
        v = fields[k]
        if not isinstance(v, tp) or (tp is int and isinstance(v, bool)):
            raise PackingError(f"ipc handle: field {k!r} has type {type(v).__name__}")
    if fields["nbytes"] < 0 or fields["nbytes"] > fields["storage_size_bytes"]:
        raise PackingError("ipc handle: nbytes exceeds the shared storage")
    return fields


def ipc_import(fields: dict[str, Any], device_index: int) -> torch.Tensor:
    """Open an exported buffer on this process's ``device_index`` (same physical GPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    f = check_ipc_fields(fields)
    n = f["nbytes"]
    return rebuild_cuda_tensor(
        torch.Tensor, (n,), (1,), 0, torch.storage.TypedStorage, torch.uint8, device_index,
        f["handle"], f["storage_size_bytes"], f["storage_offset_bytes"], False,
        f["ref_counter_handle"], f["ref_counter_offset"], f["event_handle"],
        f["event_sync_required"])


def pack_buckets(buckets: Iterable[dict[str, torch.Tensor]], layout: Layout,
                 flat: torch.Tensor) -> int:
    """Copy each bucket's tensors into their views of ``flat`` (``copy_`` casts to the
    layout's dtype), one bucket at a time; returns the number of buckets.

    A bucket may be freed as soon as the next one is asked for (a sharded learner's gathered
    parameters), so a bucket read from a GPU is complete before we move on. Every bucket is
    consumed even after a failed copy (each may be a collective that other ranks run in step);
    the first error is raised at the end, as is a layout tensor that no bucket carried."""
    views = unpack(flat, layout)
    done: set[str] = set()
    error: BaseException | None = None
    n = 0
    for bucket in buckets:
        n += 1
        if error is not None:
            continue
        try:
            cuda = False
            for name, t in bucket.items():
                view = views[name]
                view.copy_(t.detach().reshape(view.shape), non_blocking=True)
                cuda = cuda or t.is_cuda or view.is_cuda
                done.add(name)
            if cuda:
                torch.cuda.current_stream().synchronize()
        except Exception as e:  # raised below, once every bucket is consumed
            error = e
    if error is not None:
        raise error
    missing = [e.name for e in layout if e.name not in done]
    if missing:
        raise PackingError(f"{len(missing)} tensor(s) of the layout came in no bucket, "
                           f"e.g. {missing[:3]}")
    return n


def bucket_ranges(layout: Layout, bucket_bytes: int) -> list[tuple[int, int]]:
    """The byte ranges [start, end) of a packed buffer that hold ``plan_buckets``' buckets:
    cut at tensor boundaries, each end aligned, together covering ``total_bytes(layout)``."""
    by_name = {e.name: e for e in layout}
    out = []
    for names in plan_buckets(layout, bucket_bytes):
        first, last = by_name[names[0]], by_name[names[-1]]
        out.append((first.offset, last.offset + -(-last.nbytes // ALIGN) * ALIGN))
    return out


def ranges_from_wire(data: Any, layout: Layout) -> list[tuple[int, int]]:
    """Validate bucket ranges received over the wire: in order, contiguous, cut at tensor
    boundaries, covering the whole layout."""
    starts = {e.offset for e in layout}
    total = total_bytes(layout)
    if not isinstance(data, list) or not data:
        raise PackingError(f"buckets: expected a non-empty list, got {type(data).__name__}")
    out, at = [], 0
    for i, row in enumerate(data):
        if not (isinstance(row, list) and len(row) == 2 and all(type(x) is int for x in row)):
            raise PackingError(f"buckets[{i}]: expected [start, end]")
        start, end = row
        if start != at or end <= start or end > total or start not in starts or \
                (end != total and end not in starts):
            raise PackingError(f"buckets[{i}]: [{start}, {end}) does not continue the previous "
                               f"bucket at a tensor boundary (layout of {total} bytes)")
        out.append((start, end))
        at = end
    if at != total:
        raise PackingError(f"buckets: cover {at} of the layout's {total} bytes")
    return out


def bucket_layout(layout: Layout, start: int, end: int) -> Layout:
    """The entries of ``layout`` inside [start, end), offsets relative to ``start``."""
    return tuple(Entry(e.name, e.dtype, e.shape, e.offset - start) for e in layout
                 if start <= e.offset < end)
