"""vLLM worker extension that loads weight snapshots inside the engine's workers.

Passed to vLLM as ``worker_extension_cls="sync.worker_ext.WeightSyncExtension"``; its methods are
called through ``AsyncLLM.collective_rpc`` and run in every worker process (CPU or GPU), so the
weights never cross the engine-core boundary as Python objects: only a path and a checksum do
(``file``), plain IPC handle fields (``ipc``), or a NCCL link's unique id (``nccl``).

Every weight route ends in the same two steps: a *stage* that leaves ``_sync_staged`` = (file ref of
the version, name -> tensor) fully received and checked, and ``sync_apply_staged`` inside the
barrier's pause. The file ref is the rollback target whichever route delivered the tensors.
Bucketed versions (nccl, and ipc from a sharded learner) are loaded bucket by bucket inside the
pause as they arrive (``_sync_apply_buckets``: one bucket of staging, never a second model on
the GPU); their ``sync_apply_staged`` only commits, and a bucket refused after others were
loaded re-applies the previous weights before the error returns.

Invariant: a load either fully succeeds or leaves the worker serving the previous weights. Any
check that can fail (read, checksum, names, shapes) runs before the first tensor is copied; if
``load_weights`` itself fails part-way, the previous snapshot (or the base checkpoint) is
re-applied before the error is returned.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from safetensors.torch import load_file

from sync.lora import BaseWeights, merge_adapter
from sync.packing import (
    bucket_layout,
    check_layout,
    ipc_import,
    layout_from_wire,
    ranges_from_wire,
    total_bytes,
    unpack,
)
from sync.snapshot import (
    SnapshotError,
    SnapshotRef,
    base_snapshot_files,
    check_against_manifest,
    model_manifest,
    read_snapshot,
)

# vLLM's in-place reload warns, per layer and per swap, about every layer a snapshot leaves out;
# partial snapshots (freeze_layers, LoRA) leave them out on purpose (those layers keep their
# weights), and the demo printed ~4,800 such lines. Names and shapes were checked already.
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                   "vllm.model_executor.model_loader.reload.inplace")


@contextlib.contextmanager
def _quiet_partial_reload() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _RELOAD_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


class WeightSyncExtension:
    """Mixed into vLLM's Worker class by vLLM itself (hence no __init__ and getattr defaults)."""

    def _sync_model_dir(self) -> str:
        return self.vllm_config.model_config.model  # type: ignore[attr-defined]

    def _sync_apply(self, tensors: dict) -> None:
        from vllm.platforms import current_platform

        runner = self.model_runner  # type: ignore[attr-defined]
        if current_platform.is_cpu() and hasattr(runner, "reload_weights"):
            # The CPU backend repacks linear weights for oneDNN and frees the originals, so a
            # plain load_weights would hit empty parameters; vLLM's in-place reload restores
            # the checkpoint layout, loads, and repacks.
            with _quiet_partial_reload():
                runner.reload_weights(weights_iterator=iter(tensors.items()),
                                      is_checkpoint_format=True)
        else:
            runner.model.load_weights(weights=list(tensors.items()))

    def sync_lora_merge(self, scale: float) -> None:
        """From now on every snapshot file is a LoRA adapter to merge into the model's own
        weights (W0 + ``scale`` * B @ A, ``sync.lora.merge_adapter``) before it is loaded:
        versions cost an adapter's bytes and the engine serves merged weights, without vLLM's
        LoRA kernels (``sync.lora_adapters: merge``)."""
        self._sync_lora_scale = float(scale)

    def _sync_read(self, ref: SnapshotRef) -> dict:
        """The tensors of snapshot ``ref`` to load: as written, or merged from its adapter."""
        tensors = read_snapshot(ref)
        scale = getattr(self, "_sync_lora_scale", None)
        if scale is None:
            return tensors
        base = getattr(self, "_sync_lora_base", None)
        if base is None:
            base = self._sync_lora_base = BaseWeights(self._sync_model_dir())
        import torch

        device = self._sync_device() if torch.cuda.is_available() else None
        return merge_adapter(tensors, base, scale, device)

    def _sync_restore_previous(self) -> None:
        prev: SnapshotRef | None = getattr(self, "_sync_last_good", None)
        if prev is not None:
            self._sync_apply(self._sync_read(prev))
            return
        for path in base_snapshot_files(self._sync_model_dir()):
            self._sync_apply(load_file(path))

    def _sync_checked_layout(self, version: int, layout_wire: Any):
        layout = layout_from_wire(layout_wire)
        manifest = getattr(self, "_sync_manifest", None)
        if manifest is None:
            manifest = model_manifest(self._sync_model_dir())
            self._sync_manifest = manifest
        check_layout(layout, manifest, version)
        return layout

    def _sync_device(self):
        import torch

        dev = getattr(self, "device", None)
        if isinstance(dev, torch.device) and dev.type == "cuda":
            return dev
        return torch.device("cuda", torch.cuda.current_device())

    def sync_device_info(self) -> dict[str, Any]:
        """This worker's GPU UUID ("" on CPU): the learner picks ipc/nccl/file from it."""
        from vllm.platforms import current_platform

        if not current_platform.is_cuda():
            return {"gpu_uuid": "", "rank": int(getattr(self, "rank", 0))}
        import torch

        dev = self._sync_device()
        return {"gpu_uuid": str(torch.cuda.get_device_properties(dev).uuid),
                "rank": int(getattr(self, "rank", 0))}

    def sync_ipc_stage(self, version: int, fields: dict, layout_wire: list, uri: str,
                       checksum: str) -> dict[str, Any]:
        """Open the learner's packed buffer for ``version`` (same GPU) and check its layout.

        No copy: the staged tensors are views of the learner's memory until the apply copies
        them into the model. The learner's GPU UUID must be ours (else the handle would name
        another device's memory)."""
        import torch

        t0 = time.perf_counter()
        self._sync_staged = None
        dev = self._sync_device()
        uuid = str(torch.cuda.get_device_properties(dev).uuid)
        if fields.get("gpu_uuid") != uuid:
            raise SnapshotError(f"v{version}: IPC handle is for GPU {fields.get('gpu_uuid')}, "
                                f"this worker is on {uuid}")
        layout = self._sync_checked_layout(version, layout_wire)
        ref = SnapshotRef(version=version, uri=uri, checksum=checksum)
        if "slots" in fields:  # a sharded learner hands the version over bucket by bucket
            return self._sync_stage_slots(ref, fields, layout, dev) | {
                "open_s": time.perf_counter() - t0}
        flat = ipc_import(fields, dev.index)
        if flat.numel() < total_bytes(layout):
            raise SnapshotError(f"v{version}: IPC buffer of {flat.numel()} bytes is smaller "
                                f"than its layout ({total_bytes(layout)})")
        self._sync_staged = (ref, unpack(flat, layout))
        return {"open_s": time.perf_counter() - t0, "tensors": len(layout)}

    def _sync_stage_slots(self, ref: SnapshotRef, fields: dict, layout: Any, dev: Any
                          ) -> dict[str, Any]:
        """Open the learner's two bucket slots (kept open while the handles stay the same) and
        its control block; nothing is read yet (``sync_ipc_receive``, inside the pause)."""
        from sync.slots import ControlBlock, control_path_ok

        handles, path = fields.get("slots"), fields.get("control")
        if not (isinstance(handles, list) and len(handles) == 2 and control_path_ok(path)):
            raise SnapshotError(f"v{ref.version}: malformed IPC slot fields")
        ranges = ranges_from_wire(fields.get("buckets"), layout)
        key = (path, tuple(h.get("handle") if isinstance(h, dict) else None for h in handles))
        opened = getattr(self, "_sync_slots", None)
        if opened is None or opened[0] != key:
            if opened is not None:
                opened[2].close()
            slots = [ipc_import(h, dev.index) for h in handles]
            opened = (key, slots, ControlBlock(path))
            self._sync_slots = opened
        biggest = max(end - start for start, end in ranges)
        if any(s.numel() < biggest for s in opened[1]):
            raise SnapshotError(f"v{ref.version}: IPC slots of {opened[1][0].numel()} bytes "
                                f"cannot hold a bucket of {biggest}")
        # Forget any earlier hand-over before we ask for this one (the learner starts only
        # once we say we are paused), so a stale block of the same version is never read.
        opened[2][0] = -1
        self._sync_staged = None
        self._sync_bucketed = (ref, layout, ranges)
        return {"tensors": len(layout), "buckets": float(len(ranges))}

    def _sync_apply_buckets(self, ref: SnapshotRef, layout: Any, ranges: list,
                            receive: Any) -> dict[str, Any]:
        """Inside the pause: ``receive(on_bucket)`` calls ``on_bucket(i, bytes)`` for each
        bucket in turn, checked; each is loaded at once, so no whole second copy of the model
        is ever staged on this GPU. A bucket refused or missing after others were loaded
        re-applies the previous weights (``_sync_restore_previous``) before raising: the engine
        never serves a torn set. On success the version is staged as loaded, for
        ``sync_apply_staged`` to commit."""
        t0 = time.perf_counter()
        self._sync_staged = None
        loaded = [0]

        def on_bucket(i: int, buf: Any) -> None:
            start, end = ranges[i]
            self._sync_apply(unpack(buf, bucket_layout(layout, start, end)))
            loaded[0] += 1

        try:
            receive(on_bucket)
            _sync_device_barrier()
        except Exception as e:
            restored = ""
            if loaded[0]:
                try:
                    self._sync_restore_previous()
                    restored = ", previous weights restored"
                except Exception as r:  # say both: the engine may now serve a torn set
                    restored = f", restoring the previous weights failed too: {r!r}"
            raise SnapshotError(f"{e} ({loaded[0]} of {len(ranges)} buckets loaded{restored})"
                                ) from None
        self._sync_staged = (ref, {})
        return {"receive_s": time.perf_counter() - t0, "buckets": float(len(ranges))}

    def sync_ipc_receive(self, version: int, timeout_s: float) -> dict[str, Any]:
        """Take the version staged by ``sync_ipc_stage`` bucket by bucket through the slots
        (call inside the pause, after telling the learner we wait)."""
        from sync.slots import receive_buckets

        staged = getattr(self, "_sync_bucketed", None)
        opened = getattr(self, "_sync_slots", None)
        if staged is None or staged[0].version != version or opened is None:
            raise SnapshotError(f"v{version}: no IPC slots staged on this worker")
        self._sync_bucketed = None
        ref, layout, ranges = staged
        deadline = time.monotonic() + timeout_s
        return self._sync_apply_buckets(ref, layout, ranges, lambda on_bucket: receive_buckets(
            opened[2], version, ranges, opened[1], deadline, on_bucket))

    def sync_nccl_join(self, epoch: int, unique_id: bytes, rank_offset: int, world_size: int,
                       timeout_s: float) -> dict[str, Any]:
        """Join NCCL link ``epoch`` with the learner as rank ``rank_offset + worker rank``.

        ``ncclCommInitRank`` cannot be bounded (``timeout_s`` is kept for the call's shape):
        the producer calls this only after telling the learner, which joins at once."""
        from sync import nccl

        t0 = time.perf_counter()
        old = getattr(self, "_sync_nccl", None)
        self._sync_nccl = None
        if old is not None:
            nccl.abort(old[1])
        rank = rank_offset + int(getattr(self, "rank", 0))
        comm = nccl.connect(unique_id, rank, world_size, self._sync_device())
        self._sync_nccl = (epoch, comm)
        return {"join_s": time.perf_counter() - t0}

    def sync_nccl_receive(self, version: int, epoch: int, layout_wire: list, timeout_s: float,
                          uri: str, checksum: str, buckets_wire: list | None = None
                          ) -> dict[str, Any]:
        """Receive ``version`` on link ``epoch`` bucket by bucket and load each bucket as it
        arrives (call inside the pause; ``_sync_apply_buckets``): one bucket of staging on this
        GPU, never a whole second model.

        A header (version, bytes, buckets) comes first: the learner answers -1 when it no longer
        holds the version (returns ``refused``; the link stays up). Each bucket then comes with
        its own header (index, bytes, checksum), checked before it is loaded: a torn or missing
        bucket is refused and the previous weights restored. Any failure or timeout aborts the
        link (the learner offers a new one)."""
        import torch

        from sync import nccl
        from sync.slots import BucketError, word_sum

        t0 = time.perf_counter()
        self._sync_staged = None
        link = getattr(self, "_sync_nccl", None)
        if link is None or link[0] != epoch:
            raise SnapshotError(f"v{version}: NCCL link epoch {epoch} is not joined here")
        layout = self._sync_checked_layout(version, layout_wire)
        total = total_bytes(layout)
        ranges = ranges_from_wire(buckets_wire, layout) if buckets_wire else \
            [(0, total)] if total else []
        dev, comm = self._sync_device(), link[1]
        deadline = time.monotonic() + timeout_s

        def header(what: str) -> list[int]:
            h = torch.zeros(3, dtype=torch.int64, device=dev)
            nccl.timed_broadcast(comm, h, deadline=deadline, what=what)
            return [int(x) for x in h.tolist()]

        def receive(on_bucket: Any) -> None:
            staging = torch.empty(max((e - s for s, e in ranges), default=0),
                                  dtype=torch.uint8, device=dev)
            self._sync_gpu_staging = True  # released to the driver after the apply
            for i, (start, end) in enumerate(ranges):
                got_i, nbytes, want = header(f"header of v{version} bucket {i}")
                if got_i != i or nbytes != end - start:
                    raise BucketError(f"v{version}: bucket {got_i} of {nbytes} bytes arrived, "
                                      f"expected bucket {i} of {end - start}; refused")
                buf = staging[:nbytes]
                nccl.timed_broadcast(comm, buf, deadline=deadline,
                                     what=f"v{version} bucket {i} of {len(ranges)}")
                if word_sum(buf) != want:
                    raise BucketError(f"v{version} bucket {i}: checksum mismatch (torn "
                                      f"bucket); refused")
                on_bucket(i, buf)

        try:
            got_version, size, n = header(f"header of v{version}")
            if got_version == -1:  # nothing follows: the link stays usable
                return {"refused": 1.0, "receive_s": time.perf_counter() - t0}
            if got_version != version or size != total or n != len(ranges):
                raise SnapshotError(f"v{version}: learner sends v{got_version} of {size} bytes "
                                    f"in {n} buckets, expected {total} bytes in {len(ranges)}")
            ref = SnapshotRef(version=version, uri=uri, checksum=checksum)
            got = self._sync_apply_buckets(ref, layout, ranges, receive)
        except Exception:
            self._sync_nccl = None
            nccl.abort(comm)
            raise
        return got | {"receive_s": time.perf_counter() - t0, "bytes": float(size)}

    def sync_scheduled_requests(self) -> list[str]:
        """Ids (vLLM's internal form) of the requests this worker's model runner holds state for.

        A request enters the model runner the first time the scheduler gives it tokens to
        compute, so an id missing here has no KV computed yet (its prompt blocks may still be
        in the prefix cache under its salt; see the barrier). The RPC queues behind any step
        already sent to this worker, so the answer covers every step scheduled before it.
        Both vLLM 0.25 and 0.32 ship two runners: V1 keeps ``requests`` (id -> cached state,
        preempted requests included), V2 ``req_states.req_id_to_index``.
        """
        runner = self.model_runner  # type: ignore[attr-defined]
        held = getattr(runner, "requests", None)
        if not isinstance(held, dict):
            held = getattr(getattr(runner, "req_states", None), "req_id_to_index", None)
        if not isinstance(held, dict):
            raise RuntimeError(f"cannot list the requests of {type(runner).__name__}: neither "
                               f"'requests' (V1 runner) nor 'req_states.req_id_to_index' (V2)")
        return list(held)

    def sync_stage_snapshot(self, version: int, uri: str, checksum: str) -> dict[str, Any]:
        """Read and verify snapshot ``version`` while the engine keeps serving.

        Reading and hashing need no pause (0.06 s for a 0.5B model on an H100 with blake3 over
        a mapping; 2.7 s with blake2b over a bytes copy); only ``sync_apply_staged`` runs inside
        the pause.
        """
        t0 = time.perf_counter()
        ref = SnapshotRef(version=version, uri=uri, checksum=checksum)
        self._sync_staged = None
        tensors = self._sync_read(ref)
        manifest = getattr(self, "_sync_manifest", None)
        if manifest is None:
            manifest = model_manifest(self._sync_model_dir())
            self._sync_manifest = manifest
        check_against_manifest(tensors, manifest, version)
        self._sync_staged = (ref, tensors)
        return {"read_s": time.perf_counter() - t0, "tensors": len(tensors)}

    def sync_apply_staged(self, version: int) -> dict[str, Any]:
        """Load the staged snapshot into the model (call with the engine paused)."""
        staged = getattr(self, "_sync_staged", None)
        if staged is None or staged[0].version != version:
            raise SnapshotError(f"snapshot v{version} was not staged on this worker")
        ref, tensors = staged
        self._sync_staged = None
        t0 = time.perf_counter()
        try:
            if tensors:  # empty: loaded bucket by bucket already, this commits it
                self._sync_apply(tensors)
            _sync_device_barrier()
        except Exception as e:
            self._sync_restore_previous()
            raise SnapshotError(f"snapshot v{version}: load_weights failed ({e!r}); previous "
                                f"weights restored") from None
        if ref.uri:  # a GPU copy announced before its file: the last file stays the rollback
            self._sync_last_good = ref
        del tensors, staged  # IPC views: the learner may reuse that memory from here on
        if getattr(self, "_sync_gpu_staging", False):
            # The NCCL staging buffer (a whole model, outside vLLM's memory budget) goes back to
            # the driver instead of sitting in this worker's allocator cache. Only then: the
            # call synchronises the device, inside the pause.
            import torch

            self._sync_gpu_staging = False
            torch.cuda.empty_cache()
        return {"apply_s": time.perf_counter() - t0}

    def sync_load_snapshot(self, version: int, uri: str, checksum: str) -> dict[str, Any]:
        """Stage and apply in one call (for callers that pause before reading)."""
        staged = self.sync_stage_snapshot(version, uri, checksum)
        return staged | self.sync_apply_staged(version)


def _sync_device_barrier() -> None:
    """Wait for the copies out of staged tensors (IPC views, NCCL staging) before they go."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
