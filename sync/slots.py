"""A version handed over bucket by bucket through two shared slots (the bucketed ``ipc`` route).

A sharded learner keeps a version in host memory (a whole second model on its GPU would not fit
beside the shards and the engine). A producer on the same GPU takes it through two GPU buffers
of one bucket each, exported once by CUDA IPC (``sync.packing.ipc_export``), while its engine is
paused: the learner copies bucket i into slot i % 2, the worker loads it into the model and
hands the slot back, and the learner refills it with bucket i + 2 meanwhile.

The hand-over is a control block of 8 int64 in a shared-memory file (the learner creates it, the
worker maps it; both processes are on one host because they share a GPU):
  [0] version being handed over   [1] buckets filled     [2] buckets done (loaded)
  [3] state: 0 running, 1 refused (version no longer held), 2 worker failed, 3 learner failed
  [4], [5] checksum of slot 0, 1  [6], [7] bytes in slot 0, 1
Each side writes only its own words, after its GPU work is complete (stream synchronised), and
reads the other's by polling against a deadline. Invariants: a bucket is read only after its
filled count, size and checksum say it is complete (a torn or missing bucket is refused with
its index); a slot is refilled only after the worker marked it done; every wait has a deadline
and a failure of either side is seen by the other at once through the state word.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch

from sync.packing import PackingError

VERSION, FILLED, DONE, STATE, SUM0, NBYTES0 = 0, 1, 2, 3, 4, 6
RUNNING, REFUSED, WORKER_FAILED, LEARNER_FAILED = 0, 1, 2, 3
_WORDS = 8
POLL_S = 2e-4


def control_path(shm_dir: str, pid: int, producer_id: str) -> str:
    return f"{shm_dir}/pipeline-slots-{pid}-{producer_id}"


def control_path_ok(path: object) -> bool:
    """Whether an announced control block path is one the learner makes (a worker writes into
    it: never let an announce point it at another file)."""
    return isinstance(path, str) and re.fullmatch(
        r"/dev/shm/pipeline-slots-\d+-[A-Za-z0-9_.-]+", path) is not None and ".." not in path


class BucketError(PackingError):
    """A bucket that must not be loaded, or a hand-over that failed (the message says which)."""


SUM_CHUNK = 16 << 20  # int32 words per reduction of word_sum


def word_sum(buf: torch.Tensor) -> int:
    """A cheap checksum of a bucket's bytes (int32 words summed into int64), computed where the
    bytes are (on the GPU: a few reductions, one sync): a torn or half-written bucket does not
    match. A reduction to int64 copies its int32 input to int64 first, so a whole 1 GiB bucket
    in one would allocate 2 GiB beside it (on the learner's or the engine's GPU, every version):
    it runs ``SUM_CHUNK`` words at a time, whose copy is 128 MiB."""
    if not buf.numel():
        return 0
    n = buf.numel() - buf.numel() % 4
    words = buf[:n].view(torch.int32)
    total = buf[n:].to(torch.int64).sum()
    for i in range(0, len(words), SUM_CHUNK):
        total += words[i: i + SUM_CHUNK].sum(dtype=torch.int64)
    return int(total)


class ControlBlock:
    """The 8 shared int64 words (see the module docstring)."""

    def __init__(self, path: str | Path, create: bool = False):
        self.path = str(path)
        if create:  # a new file, never one a worker still maps (truncating it would fault)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, _WORDS * 8)
        else:
            fd = os.open(self.path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, _WORDS * 8)
        finally:
            os.close(fd)
        self.words = memoryview(self._mm).cast("q")

    def __getitem__(self, i: int) -> int:
        return self.words[i]

    def __setitem__(self, i: int, value: int) -> None:
        self.words[i] = value

    def close(self) -> None:
        self.words.release()
        self._mm.close()


def _wait(cond: Callable[[], bool], deadline: float, what: str,
          failed: Callable[[], str | None]) -> None:
    while not cond():
        why = failed()
        if why:
            raise BucketError(f"{what}: {why}")
        if time.monotonic() > deadline:
            raise BucketError(f"{what}: timed out")
        time.sleep(POLL_S)


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


def serve_buckets(ctl: ControlBlock, version: int, flat: torch.Tensor | None,
                  ranges: list[tuple[int, int]], slots: list[torch.Tensor],
                  deadline: float) -> None:
    """Learner: hand ``flat``'s ``ranges`` to the worker through ``slots`` (``flat`` None: the
    version is no longer held, the worker is told so and loads the file)."""
    ctl[FILLED] = 0
    ctl[DONE] = 0
    ctl[STATE] = RUNNING if flat is not None else REFUSED
    ctl[VERSION] = version  # last: the worker waits for it, then reads the words above
    if flat is None:
        return

    def worker_failed() -> str | None:
        return "the worker gave up" if ctl[STATE] == WORKER_FAILED else None

    try:
        for i, (start, end) in enumerate(ranges):
            _wait(lambda i=i: ctl[DONE] >= i - 1, deadline,
                  f"v{version} bucket {i}: slot {i % 2} not handed back", worker_failed)
            slot = slots[i % 2][:end - start]
            slot.copy_(flat[start:end], non_blocking=True)
            _sync(slot)
            ctl[SUM0 + i % 2] = word_sum(slot)
            ctl[NBYTES0 + i % 2] = end - start
            ctl[FILLED] = i + 1
        _wait(lambda: ctl[DONE] >= len(ranges), deadline,
              f"v{version}: the worker did not load every bucket", worker_failed)
    except BaseException:
        if ctl[STATE] == RUNNING:
            ctl[STATE] = LEARNER_FAILED
        raise


def receive_buckets(ctl: ControlBlock, version: int, ranges: list[tuple[int, int]],
                    slots: list[torch.Tensor], deadline: float,
                    on_bucket: Callable[[int, torch.Tensor], None]) -> None:
    """Worker: take each bucket as the learner fills it, check it (index, size, checksum),
    ``on_bucket(i, bytes)`` (loads it; the bytes are valid only during the call), hand the
    slot back. Any failure tells the learner (state word) and raises BucketError."""
    def learner_state() -> str | None:
        if ctl[VERSION] != version:
            return None
        return {REFUSED: f"the learner no longer holds v{version}",
                LEARNER_FAILED: "the learner gave up"}.get(ctl[STATE])

    try:
        _wait(lambda: ctl[VERSION] == version, deadline,
              f"v{version}: the learner did not start the hand-over", lambda: None)
        why = learner_state()
        if why:
            raise BucketError(f"v{version}: {why}")
        for i, (start, end) in enumerate(ranges):
            _wait(lambda i=i: ctl[FILLED] >= i + 1, deadline,
                  f"v{version} bucket {i} of {len(ranges)} never arrived", learner_state)
            n = ctl[NBYTES0 + i % 2]
            if n != end - start:
                raise BucketError(f"v{version} bucket {i}: {n} bytes in the slot, the manifest "
                                  f"says {end - start}; refused")
            buf = slots[i % 2][:n]
            got, want = word_sum(buf), ctl[SUM0 + i % 2]
            if got != want:
                raise BucketError(f"v{version} bucket {i}: checksum {got} != {want} (torn "
                                  f"bucket); refused")
            on_bucket(i, buf)
            _sync(buf)
            ctl[DONE] = i + 1
    except BaseException as e:
        if ctl[STATE] == RUNNING:
            ctl[STATE] = WORKER_FAILED
        if isinstance(e, BucketError):
            raise
        raise BucketError(f"v{version}: {e!r}") from e
