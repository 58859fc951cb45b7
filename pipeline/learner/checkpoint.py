"""Atomic, lossless checkpoints: model, optimiser, scheduler, counters and the rollout buffer.

Layout: ``run_dir/checkpoints/step_<N>/`` plus a ``LATEST`` file naming the newest one. A
checkpoint is written into a temporary directory, fsynced, renamed, and only then is ``LATEST``
replaced (also by rename), so a crash or a full disk mid-save leaves the previous checkpoint
intact and named by ``LATEST``. Only our own files are ever loaded (``weights_only=True``).

Under DeepSpeed a ``shards`` callback lets every learner rank write its partitions (optimiser
state, ZeRO-3 parameters) into the same temporary directory (``step_<N>/deepspeed/``, DeepSpeed's
own format, read back only by DeepSpeed on resume) before it is fsynced and renamed: a checkpoint
is all ranks' files or none.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch


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
    tmp = root / f".tmp_step_{state.step}_{os.getpid()}"
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
