"""Atomic, lossless checkpoints: model, optimiser, scheduler, counters and the rollout buffer.

Layout: ``run_dir/checkpoints/step_<N>/`` plus a ``LATEST`` file naming the newest one. A
checkpoint dir holds ``state.json`` (``LearnerState``), ``buffer.msgpack``, ``trainer.json`` (the
trainer state's structure, its tensors by name) and the tensors themselves in
``tensors-<i>.safetensors`` files of at most ``SHARD_BYTES``, written by ``WRITE_THREADS``
threads at once (one ``torch.save`` stream cannot keep a disk busy). Only our own files are ever
loaded: safetensors and JSON, nothing unpickled (older ``trainer.pt`` checkpoints load with
``weights_only=True``).

Atomic: a checkpoint is written into a temporary directory, fsynced, renamed to a name nothing
holds yet (a rewrite of step N goes to ``step_<N>-<k>`` beside ``step_<N>``), and only then is
``LATEST`` switched (a fsynced temporary file, renamed); older checkpoints are removed after
that. So ``LATEST`` names a complete checkpoint at every instant: a crash, a kill or a full disk
mid-save leaves the previous one named and intact, and a failed save removes its own partial
directory.

Under DeepSpeed a ``shards`` callback lets every learner rank write its partitions (optimiser
state, ZeRO-3 parameters) into the same temporary directory (``step_<N>/deepspeed/``, DeepSpeed's
own format, read back only by DeepSpeed on resume) before it is fsynced and renamed: a checkpoint
is all ranks' files or none.

Off the training path (``CheckpointWriter``): the state is copied into host buffers allocated once
before the first step (``Staging``; page-locked for GPU tensors), on a side CUDA stream (CPU
tensors: in a thread) that overlaps the next step's forward and backward; only the next optimiser
step waits for the copy (``CheckpointWriter.fence``), as the parameters must not change under it.
The file write then runs in a thread while training goes on. At most one write is in flight: a
checkpoint that comes due meanwhile is skipped and counted, never waited for (the final one
waits). ``on_durable`` runs only once a write is complete and named by ``LATEST`` (what the learner
tells producers they may forget must be on disk). A process killed mid-write leaves ``LATEST``
naming the previous checkpoint and a ``.tmp_step_*`` directory, removed by the next writer once
its process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pickle
import re
import shutil
import socket
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from pipeline.learner.disk import STEP_DIR, step_dirs

log = logging.getLogger(__name__)
_HOST = socket.gethostname().replace("/", "-")  # temp dirs name their writer: host and pid
DEEPSPEED_DIR = "deepspeed"  # inside a checkpoint dir: DeepSpeed's files, every rank's partitions
DEEPSPEED_TAG = "zero"  # DeepSpeed's tag (its subdirectory) of those files
TRAINER_JSON = "trainer.json"
SHARD_BYTES = 1 << 30  # per tensors file: bounds what one thread holds, spreads a big state
MIN_SHARD_BYTES = 64 << 20  # a small state still spreads over the threads, in files this big
WRITE_THREADS = 8  # files written at once (bench/checkpoint_bench.py measures the choice)


class CheckpointError(RuntimeError):
    pass


# Not a failed write: these stop the process, and a save they land in passes them on.
_INTERRUPTS = (KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError)


@dataclass
class LearnerState:
    """Everything besides tensors that a resumed learner needs to carry on exactly."""

    step: int = 0
    version: int = 0
    received: dict[str, int] = field(default_factory=dict)   # groups received per producer
    cursors: dict[str, int] = field(default_factory=dict)    # dataset cursor per producer
    counters: dict[str, float] = field(default_factory=dict)  # cumulative run counters
    first_reward: float | None = None
    ledger: dict = field(default_factory=dict)  # buffer.ledger.GroupLedger.to_dict()


def failure_text(e: BaseException) -> str:
    """One line for a failed write: DCP's CheckpointException by the failures it gathered (its
    own text is a traceback per rank), any other by its type and message."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = [f"{type(x).__name__}: {x}" for x, _trace in
                 (v if isinstance(v, tuple) else (v, None) for v in failures.values())]
    else:
        parts = [f"{type(e).__name__}: {e}"]
    return " ".join("; ".join(dict.fromkeys(parts)).split())


def _fsync(path: Path) -> None:
    """fsync a file or a directory (a directory's entries: a rename in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(top: Path) -> None:
    for dirpath, _dirs, files in os.walk(top):
        for name in files:
            _fsync(Path(dirpath) / name)
        _fsync(Path(dirpath))


# ------------------------------------------------------------------ the trainer state's structure
def _encode(obj: Any, flat: dict[str, torch.Tensor], seen: dict[tuple, str]) -> Any:
    """JSON for ``obj`` with each tensor replaced by its name in ``flat`` (CPU, contiguous);
    tensors sharing memory (tied weights) are stored once. Dict keys keep their type (int keys
    of an optimiser state), tuples stay tuples."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        key = (t.device, t.dtype, t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            return {"t": seen[key]}
        name = str(len(flat))
        flat[name] = t.cpu().contiguous()
        if t.numel():
            seen[key] = name
        return {"t": name}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise TypeError(f"a checkpoint's dict keys are str or int, not {k!r}")
            items.append([k, _encode(v, flat, seen)])
        return {"d": items}
    if isinstance(obj, (list, tuple)):
        return {"l" if isinstance(obj, list) else "u": [_encode(v, flat, seen) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"a checkpoint cannot hold a {type(obj).__name__}")


def _decode(obj: Any, flat: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "t" in obj:
            return flat[obj["t"]]
        if "d" in obj:
            return {k: _decode(v, flat) for k, v in obj["d"]}
        items = [_decode(v, flat) for v in obj.get("l", obj.get("u", []))]
        return items if "l" in obj else tuple(items)
    return obj


def _shard_plan(flat: dict[str, torch.Tensor], threads: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive tensors in files of about total/threads bytes, within [MIN_SHARD_BYTES,
    SHARD_BYTES]: every thread has work, and no file is too big to write alone."""
    total = sum(t.numel() * t.element_size() for t in flat.values())
    cap = max(MIN_SHARD_BYTES, min(SHARD_BYTES, -(-total // max(threads, 1))))
    files: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in flat.items():
        n = t.numel() * t.element_size()
        if files[-1] and size + n > cap:
            files.append({})
            size = 0
        files[-1][name] = t
        size += n
    return files


def _save_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    try:
        save_file(tensors, path)
    except SafetensorError as e:  # its I/O errors: an OSError, errno kept (ENOSPC, EIO)
        m = re.search(r"os error (\d+)", str(e))
        raise OSError(int(m.group(1)) if m else 5, str(e)) from e
    _fsync(path)


def write_tensors(directory: Path, tensors: Any, threads: int = WRITE_THREADS) -> int:
    """Write the trainer state ``tensors`` (nested dicts, lists, tuples, tensors, numbers)
    into ``directory`` as ``trainer.json`` and its safetensors files, ``threads`` at once;
    returns the tensors' bytes."""
    flat: dict[str, torch.Tensor] = {}
    tree = _encode(tensors, flat, {})
    files = _shard_plan(flat, threads)
    names = [f"tensors-{i:05d}.safetensors" for i in range(len(files))]
    with ThreadPoolExecutor(max(1, min(threads, len(files)))) as pool:
        for f in [pool.submit(_save_file, part, directory / name)
                  for part, name in zip(files, names, strict=True)]:
            f.result()
    (directory / TRAINER_JSON).write_text(json.dumps({"format": 1, "files": names,
                                                      "tree": tree}))
    return sum(t.numel() * t.element_size() for t in flat.values())


def read_tensors(directory: Path, map_location: str = "cpu") -> Any:
    meta = json.loads((directory / TRAINER_JSON).read_text())
    flat: dict[str, torch.Tensor] = {}
    for name in meta["files"]:
        flat.update(load_file(directory / name, device=map_location))
    return _decode(meta["tree"], flat)


# ------------------------------------------------------------------ checkpoint directories
def _free_name(root: Path, step: int) -> Path:
    """``step_<N>``, or ``step_<N>-<k>`` beside it when a checkpoint of step N exists (it may be
    the one ``LATEST`` names, and stays until ``LATEST`` names the new one)."""
    path, k = root / f"step_{step}", 0
    while path.exists():
        k += 1
        path = root / f"step_{step}-{k}"
    return path


def _switch_latest(root: Path, name: str) -> None:
    tmp = root / ".LATEST.tmp"
    with open(tmp, "w") as fh:
        fh.write(name)
        fh.flush()
        os.fsync(fh.fileno())  # the rename must never publish an empty file
    os.replace(tmp, root / "LATEST")


def _prune(root: Path, current: Path, keep: int, previous: Path | None = None) -> None:
    """Remove checkpoints superseded by ``current`` (named by LATEST now): any other of its
    step, orphans, and all but the newest ``keep`` - 1 others. ``previous`` is the checkpoint
    LATEST named before: a directory newer than it (a later step, or a rewrite of its step) was
    renamed by a writer that died before switching LATEST, or belongs to a run LATEST was
    turned back from; it is not of the run ``current`` continues, so it is removed and never
    kept in place of ``previous`` (the checkpoint the run resumed from)."""
    step = int(STEP_DIR.match(current.name).group(1))
    others = sorted((s, p.name) for s, p in step_dirs(root) if p != current)
    drop = [n for s, n in others if s == step]
    if previous is not None and (m := STEP_DIR.match(previous.name)):
        before = int(m.group(1))
        drop += [n for s, n in others
                 if s != step and (s > before or (s == before and n != previous.name))]
    rest = [n for s, n in others if n not in drop]
    drop += rest[:max(0, len(rest) - (keep - 1))]
    for name in drop:
        shutil.rmtree(root / name, ignore_errors=True)


def save_checkpoint(run_dir: Path, state: LearnerState, tensors: dict[str, Any],
                    buffer_bytes: bytes, keep: int = 2,
                    shards: Callable[[Path], None] | None = None,
                    threads: int = WRITE_THREADS) -> Path:
    """Write a checkpoint atomically and keep the newest ``keep``; ``shards(tmp_dir)``, if
    given, adds other ranks' files (a collective under DeepSpeed: ``PolicyTrainer.save_shards``)
    before the rename. Any failure (ENOSPC, EIO, whatever a writer raises for them: DeepSpeed's
    ``torch.save`` a RuntimeError, DCP a CheckpointException, which is a BaseException) removes
    what this save wrote and raises a CheckpointError naming the previous checkpoint, which
    stays named by ``LATEST``; only an interrupt (KeyboardInterrupt, SystemExit) passes as it
    is."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp_step_{state.step}_{_HOST}_{os.getpid()}"
    final: Path | None = None
    switched = False
    previous = latest_checkpoint(run_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        write_tensors(tmp, tensors, threads)
        (tmp / "buffer.msgpack").write_bytes(buffer_bytes)
        (tmp / "state.json").write_text(json.dumps(asdict(state)))
        if shards is not None:
            shards(tmp)
        _fsync_tree(tmp)
        final = _free_name(root, state.step)
        os.replace(tmp, final)
        _fsync(root)
        _switch_latest(root, final.name)
        switched = True
        _fsync(root)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if final is not None and not switched:
            shutil.rmtree(final, ignore_errors=True)
        if isinstance(e, _INTERRUPTS) or switched:
            raise
        prev = latest_checkpoint(run_dir)
        why = " ".join(str(e).split()) if isinstance(e, (OSError, CheckpointError)) \
            else failure_text(e)
        raise CheckpointError(f"checkpoint at step {state.step} failed ({why}); the previous "
                              f"checkpoint {prev or '(none)'} is intact") from e
    _prune(root, final, keep, previous)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = Path(run_dir) / "checkpoints"
    try:
        name = (root / "LATEST").read_text().strip()
    except OSError:
        return None
    path = root / name
    return path if name and (path / "state.json").is_file() else None


def load_checkpoint(path: Path, map_location: str = "cpu"
                    ) -> tuple[LearnerState, dict[str, Any], bytes]:
    try:
        state = LearnerState(**json.loads((path / "state.json").read_text()))
        if (path / TRAINER_JSON).is_file() or not (path / "trainer.pt").is_file():
            tensors = read_tensors(path, map_location)
        else:  # written before the safetensors layout
            tensors = torch.load(path / "trainer.pt", map_location=map_location,
                                 weights_only=True)
        buf = (path / "buffer.msgpack").read_bytes()
    except (OSError, ValueError, TypeError, KeyError, RuntimeError, EOFError,
            SafetensorError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"checkpoint {path} is unreadable: {e}") from e
    return state, tensors, buf


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_partial(run_dir: Path) -> list[Path]:
    """Remove the temporary directories of writes whose process, on this host, is gone (killed
    mid-write); a live process's write, or another host's (a shared run_dir), is left alone."""
    removed = []
    for tmp in (Path(run_dir) / "checkpoints").glob(".tmp_step_*"):
        rest, _, pid = tmp.name.rpartition("_")
        if rest.endswith(f"_{_HOST}") and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


# ------------------------------------------------------------------ the copy to host memory
def tensor_bytes(obj: Any) -> tuple[int, int, bool]:
    """(bytes, count) of the distinct tensors in ``obj`` (nested dicts, lists, tuples), and
    whether any is on a GPU."""
    seen: set[tuple] = set()
    total, cuda = 0, False

    def walk(x: Any) -> None:
        nonlocal total, cuda
        if isinstance(x, torch.Tensor):
            key = (x.device, x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype)
            if not x.numel() or key not in seen:
                seen.add(key)
                total += x.numel() * x.element_size()
                cuda = cuda or x.is_cuda
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(obj)
    return total, len(seen), cuda


class Staging:
    """The host buffers copies land in, one per tensor (keyed by its place in the state), reused
    by every checkpoint: a copy then costs the copy alone, as allocating (and pinning) fresh
    memory costs more than the copy itself. ``reserve`` allocates one block before the first
    step, page-locked when the state is on a GPU (``cudaHostRegister`` of exactly its bytes; the
    caching pinned allocator would round each size up); buffers are carved from it at the
    first copy, and any it cannot hold are allocated on their own."""

    ALIGN = 64

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.block: torch.Tensor | None = None
        self.used = 0
        self.pinned = False

    def reserve(self, nbytes: int, tensors: int, pin: bool) -> None:
        """One block for ``tensors`` tensors of ``nbytes`` in all (each buffer aligned)."""
        self.block = torch.empty(nbytes + self.ALIGN * (tensors + 1), dtype=torch.uint8)
        self.used = 0
        if pin:
            self.pinned = _pin(self.block)
        else:
            self.block.fill_(0)  # fault the pages in now, not during the first checkpoint

    def get(self, path: tuple, like: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(path)
        if buf is not None and buf.shape == like.shape and buf.dtype == like.dtype:
            return buf
        n = like.numel() * like.element_size()
        start = -(-self.used // self.ALIGN) * self.ALIGN
        if self.block is not None and start + n <= self.block.numel():
            buf = self.block[start:start + n].view(like.dtype).view(like.shape)
            self.used = start + n
        else:  # pinned only beside a reserved block: an unplanned save (the final one) makes do
            buf = torch.empty(like.shape, dtype=like.dtype,
                              pin_memory=like.is_cuda and self.block is not None)
        self.buffers[path] = buf
        return buf


def _pin(block: torch.Tensor) -> bool:
    """Page-lock ``block`` in place (unlocked when it is freed); False if CUDA refuses."""
    n = block.numel() * block.element_size()
    try:
        cudart = torch.cuda.cudart()
        code = int(cudart.cudaHostRegister(block.data_ptr(), n, 0))
    except (AttributeError, RuntimeError, TypeError) as e:
        log.warning("cudaHostRegister unavailable (%s)", e)
        code = -1
    if code != 0:
        log.warning("could not page-lock %.1f GB of checkpoint staging memory: copies to it "
                    "will not overlap training", n / 1e9)
        return False
    weakref.finalize(block, cudart.cudaHostUnregister, block.data_ptr())
    return True


class HostCopy:
    """A copy of the state to host memory in flight: GPU tensors on a side stream, CPU tensors
    in a thread. ``fence`` makes the calling thread's stream (and the thread) wait for it before
    anything changes the source tensors; ``wait`` blocks until the host buffers are complete."""

    def __init__(self, events: list[tuple[torch.device, Any]],
                 thread: threading.Thread | None, errors: list[BaseException]):
        self._events = events
        self._thread = thread
        self._errors = errors

    def fence(self) -> None:
        for device, event in self._events:
            torch.cuda.current_stream(device).wait_event(event)  # on the GPU: no host wait
        if self._thread is not None:
            self._thread.join()

    def wait(self) -> None:
        for _device, event in self._events:
            event.synchronize()
        if self._thread is not None:
            self._thread.join()
        if self._errors:
            raise self._errors[0]


def _copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for src, dst in pairs:
        dst.copy_(src)


def begin_host_copy(obj: Any, staging: Staging | dict | None = None,
                    streams: dict[torch.device, Any] | None = None) -> tuple[Any, HostCopy]:
    """Start copying a nested state dict (dicts, lists, tuples) into host buffers; returns
    the copy's structure (already complete: numbers, strings, lists are captured now) and the
    ``HostCopy`` whose ``wait`` says its tensors are. Tensors sharing memory (tied weights) stay
    shared, so the file holds them once. The caller must not change the source tensors before
    ``fence`` nor reuse ``staging`` while an earlier copy is still being read."""
    if not isinstance(staging, Staging):
        own = Staging()
        if isinstance(staging, dict):  # a plain dict of buffers, kept by the caller
            own.buffers = staging
        staging = own
    seen: dict[tuple, torch.Tensor] = {}
    gpu: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    cpu: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy(x: Any, path: tuple) -> Any:
        if isinstance(x, torch.Tensor):
            t = x.detach()
            key = (t.device, t.dtype, t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if t.numel() and key in seen:
                return seen[key]
            buf = staging.get(path, t)
            (gpu.setdefault(t.device, []) if t.is_cuda else cpu).append((t, buf))
            seen[key] = buf
            return buf
        if isinstance(x, dict):
            return {k: copy(v, (*path, k)) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            items = [copy(v, (*path, i)) for i, v in enumerate(x)]
            return items if isinstance(x, list) else tuple(items)
        return x  # numbers, strings, None: immutable

    out = copy(obj, ())
    events = []
    for device, pairs in gpu.items():
        stream = (streams or {}).get(device) or torch.cuda.Stream(device)
        if streams is not None:
            streams[device] = stream
        stream.wait_stream(torch.cuda.current_stream(device))  # the step's kernels are done
        with torch.cuda.stream(stream):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
                src.record_stream(stream)  # a freed source is not reused before the copy ends
        event = torch.cuda.Event()
        event.record(stream)
        events.append((device, event))
    errors: list[BaseException] = []
    thread = None
    if cpu:
        def run() -> None:
            try:
                _copy_pairs(cpu)
            except BaseException as e:  # raised by HostCopy.wait
                errors.append(e)

        thread = threading.Thread(target=run, name="checkpoint-copy", daemon=True)
        thread.start()
    return out, HostCopy(events, thread, errors)


def host_copy(obj: Any, staging: Staging | dict | None = None) -> Any:
    """``begin_host_copy`` and wait for it: what the live tensors hold now, unaffected by later
    training steps."""
    out, pending = begin_host_copy(obj, staging)
    pending.wait()
    return out


# ------------------------------------------------------------------ the writer
class CheckpointWriter:
    """Saves checkpoints with the training loop stopped only to start the copy to host memory.

    ``prepare`` allocates the staging buffers before the first step. ``save`` starts the copy
    (``begin_host_copy``) and hands the write to a background task; it returns the seconds the
    caller was stopped, or None when a write is still in flight: that checkpoint is skipped and
    counted (``skipped``), as waiting would stop training for a whole write. The trainer calls
    ``fence`` before each optimiser step, which then waits for the copy. With ``shards``
    (DeepSpeed: every rank writes its partitions, a collective on the live engine, which the next
    training step would change under it) or ``background=False``, the whole save runs before
    ``save`` returns.

    A failed write (ENOSPC, EIO) removes its partial directory and keeps the previous checkpoint
    (``save_checkpoint``); it is counted (``failures``) and handed once to the caller by
    ``take_error``; ``on_durable`` is never called for it.
    """

    def __init__(self, run_dir: Path, keep: int = 2, threads: int = WRITE_THREADS):
        self.run_dir = Path(run_dir)
        self.keep = keep
        self.threads = threads
        self.written: Path | None = None   # the newest complete checkpoint this writer wrote
        self.write_s: float | None = None  # seconds the newest complete write took
        self.write_bytes = 0               # bytes of tensors the newest complete write wrote
        self.completed = 0                 # writes completed (a new write_s each)
        self.skipped = 0                   # checkpoints not taken: a write was in flight
        self.failures = 0                  # writes that failed
        self.stall_parts: dict[str, float] = {}  # the newest background save's stall, in parts
        self.staging = Staging()
        self._streams: dict[torch.device, Any] = {}
        self._pending: HostCopy | None = None  # the copy the next optimiser step must wait for
        self._task: asyncio.Task | None = None  # the write in flight
        self._copy: asyncio.Future | None = None  # the copy being started (fills staging)
        self._error: BaseException | None = None
        remove_partial(self.run_dir)

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    def prepare(self, nbytes: int, tensors: int, pin: bool) -> None:
        """Allocate the staging buffers before the first step: ``tensors`` tensors of
        ``nbytes`` in all (``PolicyTrainer.checkpoint_plan``), page-locked if ``pin``."""
        self.staging.reserve(nbytes, tensors, pin)

    def fence(self) -> None:
        """Make the caller wait for a copy in flight before it changes the state (the trainer
        calls it before each optimiser step; on a GPU the wait is the stream's, not the host's)."""
        pending = self._pending
        if pending is not None:
            pending.fence()

    def take_error(self) -> BaseException | None:
        """The error of a failed write, once."""
        error, self._error = self._error, None
        return error

    async def wait(self) -> Path | None:
        """Wait for the write in flight, if any. Returns the newest checkpoint."""
        if self._copy is not None:  # a save cancelled mid-copy: its thread still fills staging
            with contextlib.suppress(Exception):
                await asyncio.shield(self._copy)
        if self._task is not None:
            await asyncio.shield(self._task)  # a cancelled waiter leaves the write running
        return self.written

    async def save(self, state: LearnerState, tensors: Callable[[], dict[str, Any]],
                   buffer_bytes: bytes, on_durable: Callable[[Path], None],
                   shards: Callable[[Path], None] | None = None,
                   background: bool = True) -> float | None:
        """Checkpoint ``state`` (a copy the caller will not change), ``tensors()`` (the live
        trainer state, read now) and ``buffer_bytes``; returns the seconds spent before the
        caller may go on training, or None if skipped (a write in flight)."""
        if self.busy or (self._copy is not None and not self._copy.done()):
            self.skipped += 1
            return None
        await self.wait()
        t0 = time.monotonic()
        if shards is not None or not background:
            try:
                path = await asyncio.to_thread(save_checkpoint, self.run_dir, state, tensors(),
                                               buffer_bytes, self.keep, shards, self.threads)
            except CheckpointError as e:
                self._failed(state, e)
            else:
                self._done(path, time.monotonic() - t0, 0, on_durable)
            return time.monotonic() - t0
        marks: list[float] = []

        def start() -> tuple[Any, HostCopy]:
            marks.append(time.monotonic())  # the thread runs
            live = tensors()
            marks.append(time.monotonic())  # the state is read
            out = begin_host_copy(live, self.staging, self._streams)
            marks.append(time.monotonic())  # every copy is queued
            return out

        self._copy = asyncio.ensure_future(asyncio.to_thread(start))
        host, pending = await asyncio.shield(self._copy)
        self._copy = None
        t1 = time.monotonic()
        # Where the stall went (metrics of the step): waiting for a thread, reading the trainer's
        # state (it waits for a command holding the trainer), queueing the copies, and the
        # event loop coming back to this coroutine.
        self.stall_parts = {"checkpoint_thread_wait_s": marks[0] - t0,
                            "checkpoint_state_s": marks[1] - marks[0],
                            "checkpoint_copy_start_s": marks[2] - marks[1],
                            "checkpoint_resume_s": t1 - marks[2]}
        self._pending = pending
        self._task = asyncio.get_running_loop().create_task(
            self._write(state, host, pending, buffer_bytes, on_durable))
        return time.monotonic() - t0

    async def _write(self, state: LearnerState, host: dict[str, Any], pending: HostCopy,
                     buffer_bytes: bytes, on_durable: Callable[[Path], None]) -> None:
        t0 = time.monotonic()
        try:
            await asyncio.to_thread(pending.wait)
            self._pending = None
            path = await asyncio.to_thread(save_checkpoint, self.run_dir, state, host,
                                           buffer_bytes, self.keep, None, self.threads)
        except Exception as e:
            self._pending = None
            self._failed(state, e)
            return
        self._done(path, time.monotonic() - t0, tensor_bytes(host)[0], on_durable)

    def _failed(self, state: LearnerState, e: BaseException) -> None:
        log.debug("checkpoint at step %d failed: %s", state.step, e)
        self.failures += 1
        self._error = e

    def _done(self, path: Path, seconds: float, nbytes: int,
              on_durable: Callable[[Path], None]) -> None:
        self.written, self.write_s, self.write_bytes = path, seconds, nbytes
        self.completed += 1
        on_durable(path)
