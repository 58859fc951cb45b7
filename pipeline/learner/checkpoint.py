"""Atomic, lossless checkpoints: model, optimiser, scheduler, counters and the rollout buffer.

Layout: ``run_dir/checkpoints/step_<N>/`` plus a ``LATEST`` file naming the newest one. A
checkpoint is written into a temporary directory, fsynced, renamed, and only then is ``LATEST``
replaced (also by rename), so a crash or a full disk mid-save leaves the previous checkpoint
intact and named by ``LATEST``. Only our own files are ever loaded (``weights_only=True``).

Under DeepSpeed a ``shards`` callback lets every learner rank write its partitions (optimiser
state, ZeRO-3 parameters) into the same temporary directory (``step_<N>/deepspeed/``, DeepSpeed's
own format, read back only by DeepSpeed on resume) before it is fsynced and renamed: a checkpoint
is all ranks' files or none.

Off the training path (``CheckpointWriter``): the training loop stops only while the state is
copied to host memory (``host_copy``: pinned, reused buffers for GPU tensors); the file write,
fsync and renames of ``save_checkpoint`` then run in a thread while training goes on. At most one
write is in flight: the next checkpoint first waits for the previous one. ``on_durable`` runs only
once a write is complete and named by ``LATEST`` (what the learner tells producers they may forget
must be on disk). A process killed mid-write leaves ``LATEST`` naming the previous checkpoint and
a ``.tmp_step_*`` directory, removed by the next writer once its process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pickle
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
_HOST = socket.gethostname().replace("/", "-")  # temp dirs name their writer: host and pid
DEEPSPEED_DIR = "deepspeed"  # inside a checkpoint dir: DeepSpeed's files, every rank's partitions
DEEPSPEED_TAG = "zero"  # DeepSpeed's tag (its subdirectory) of those files


class CheckpointError(RuntimeError):
    pass


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(top: Path) -> None:
    for dirpath, _dirs, files in os.walk(top):
        for name in files:
            with open(Path(dirpath) / name, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(Path(dirpath))


def save_checkpoint(run_dir: Path, state: LearnerState, tensors: dict[str, Any],
                    buffer_bytes: bytes, keep: int = 2,
                    shards: Callable[[Path], None] | None = None) -> Path:
    """Write a checkpoint atomically; ``shards(tmp_dir)``, if given, adds other ranks' files
    (a collective under DeepSpeed: ``PolicyTrainer.save_shards``) before the rename."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{state.step}"
    tmp = root / f".tmp_step_{state.step}_{_HOST}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        torch.save(tensors, tmp / "trainer.pt")
        (tmp / "buffer.msgpack").write_bytes(buffer_bytes)
        (tmp / "state.json").write_text(json.dumps(asdict(state)))
        if shards is not None:
            shards(tmp)
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest_tmp = root / ".LATEST.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, root / "LATEST")
        _fsync_dir(root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        prev = latest_checkpoint(run_dir)
        raise CheckpointError(f"checkpoint at step {state.step} failed ({e}); the previous "
                              f"checkpoint {prev or '(none)'} is intact") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    names = sorted((p for p in root.glob("step_*") if p.is_dir()),
                   key=lambda p: int(p.name.split("_")[1]))
    for old in names[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = Path(run_dir) / "checkpoints"
    try:
        name = (root / "LATEST").read_text().strip()
    except OSError:
        return None
    path = root / name
    return path if (path / "state.json").is_file() else None


def load_checkpoint(path: Path, map_location: str = "cpu"
                    ) -> tuple[LearnerState, dict[str, Any], bytes]:
    try:
        state = LearnerState(**json.loads((path / "state.json").read_text()))
        tensors = torch.load(path / "trainer.pt", map_location=map_location, weights_only=True)
        buf = (path / "buffer.msgpack").read_bytes()
    except (OSError, ValueError, TypeError, RuntimeError, EOFError, pickle.UnpicklingError
            ) as e:
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


def host_copy(obj: Any, staging: dict[tuple, torch.Tensor] | None = None) -> Any:
    """A copy of a nested state dict (dicts, lists, tuples) whose tensors are host-memory
    copies: what the live tensors hold now, unaffected by later training steps.

    GPU tensors land in pinned memory, copied asynchronously and synchronised once at the end.
    ``staging`` (kept by the caller, keyed by position in the structure) holds the host buffers
    for reuse by the next copy, which then costs the copy alone: pinning or faulting in fresh
    memory costs more than the copy itself. The caller must not reuse ``staging`` while an
    earlier copy is still being read. Tensors sharing memory (tied weights) stay shared, so the
    file holds them once."""
    seen: dict[tuple, torch.Tensor] = {}
    devices: set[torch.device] = set()

    def copy(x: Any, path: tuple) -> Any:
        if isinstance(x, torch.Tensor):
            t = x.detach()
            key = (t.device, t.dtype, t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if t.numel() and key in seen:
                return seen[key]
            buf = staging.get(path) if staging is not None else None
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
                if staging is not None:
                    staging[path] = buf
            buf.copy_(t, non_blocking=t.is_cuda)
            if t.is_cuda:
                devices.add(t.device)
            seen[key] = buf
            return buf
        if isinstance(x, dict):
            return {k: copy(v, (*path, k)) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            items = [copy(v, (*path, i)) for i, v in enumerate(x)]
            return items if isinstance(x, list) else tuple(items)
        return x  # numbers, strings, None: immutable

    out = copy(obj, ())
    for device in devices:
        torch.cuda.synchronize(device)  # every non_blocking copy is complete
    return out


class CheckpointWriter:
    """Saves checkpoints with the training loop stopped only for the copy to host memory.

    ``save`` waits for the previous write (at most one in flight), copies the trainer's state
    with ``host_copy`` (in a thread: the event loop keeps answering producers), and hands the
    write to a background task; it returns the seconds the caller was stopped. With ``shards``
    (DeepSpeed: every rank writes its partitions, a collective on the live engine, which the
    next training step would change under it) or ``background=False``, the whole save runs before
    ``save`` returns, as the ranks must not train while their partitions are being written.

    A failed background write is logged at once, raised by ``raise_if_failed`` (the learner calls
    it every step) or the next ``wait``/``save``, once; ``on_durable`` is never called for it.
    """

    def __init__(self, run_dir: Path, keep: int = 2):
        self.run_dir = Path(run_dir)
        self.keep = keep
        self.written: Path | None = None   # the newest complete checkpoint this writer wrote
        self.write_s: float | None = None  # seconds the newest complete write took
        self.completed = 0                 # writes completed (a new write_s each)
        self._staging: dict[tuple, torch.Tensor] = {}
        self._task: asyncio.Task | None = None  # the write in flight
        self._copy: asyncio.Future | None = None  # the host copy in flight (fills _staging)
        self._error: BaseException | None = None
        remove_partial(self.run_dir)

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    async def wait(self) -> Path | None:
        """Wait for the write in flight, if any; raise its error. Returns the newest checkpoint."""
        if self._copy is not None:  # a save cancelled mid-copy: its thread still fills _staging
            with contextlib.suppress(Exception):
                await asyncio.shield(self._copy)
        if self._task is not None:
            await asyncio.shield(self._task)  # a cancelled waiter leaves the write running
        self.raise_if_failed()
        return self.written

    async def save(self, state: LearnerState, tensors: Callable[[], dict[str, Any]],
                   buffer_bytes: bytes, on_durable: Callable[[Path], None],
                   shards: Callable[[Path], None] | None = None,
                   background: bool = True) -> float:
        """Checkpoint ``state`` (a copy the caller will not change), ``tensors()`` (the live
        trainer state, read now) and ``buffer_bytes``; returns the seconds spent before the
        caller may go on training."""
        t0 = time.monotonic()
        await self.wait()
        if shards is not None or not background:
            path = await asyncio.to_thread(save_checkpoint, self.run_dir, state, tensors(),
                                           buffer_bytes, self.keep, shards)
            self._done(path, time.monotonic() - t0, on_durable)
            return time.monotonic() - t0
        self._copy = asyncio.ensure_future(
            asyncio.to_thread(lambda: host_copy(tensors(), self._staging)))
        host = await asyncio.shield(self._copy)
        self._copy = None
        self._task = asyncio.get_running_loop().create_task(
            self._write(state, host, buffer_bytes, on_durable))
        return time.monotonic() - t0

    async def _write(self, state: LearnerState, host: dict[str, Any], buffer_bytes: bytes,
                     on_durable: Callable[[Path], None]) -> None:
        t0 = time.monotonic()
        try:
            path = await asyncio.to_thread(save_checkpoint, self.run_dir, state, host,
                                           buffer_bytes, self.keep)
        except Exception as e:
            log.error("checkpoint at step %d: background write failed: %s", state.step, e)
            self._error = e
            return
        self._done(path, time.monotonic() - t0, on_durable)

    def _done(self, path: Path, seconds: float, on_durable: Callable[[Path], None]) -> None:
        self.written, self.write_s = path, seconds
        self.completed += 1
        on_durable(path)
