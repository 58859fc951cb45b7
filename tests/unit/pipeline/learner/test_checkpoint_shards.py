"""A checkpoint whose rank files (``shards``: DeepSpeed's partitions, FSDP2's DCP files) meet a
full disk is a checkpoint failure like any other: one CheckpointError naming the previous
checkpoint, counted by the writer, ``train.on_checkpoint_error`` obeyed, never an exception out
of ``CheckpointWriter.save``. The writers are the real ones on a real full filesystem (a small
tmpfs): ``torch.save`` (what DeepSpeed writes with) raises RuntimeError there, DCP's ``save`` a
CheckpointException, which is a BaseException. And the end of a learner's run releases its
sockets, files and snapshot directory whatever its final checkpoint raised."""

from __future__ import annotations

import asyncio
import uuid
import warnings

import pytest
import torch

from pipeline.learner.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    LearnerState,
    latest_checkpoint,
    save_checkpoint,
)
from tests.small_fs import small_filesystem


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs mounted for the test (root only; skipped where mounting is refused)."""
    with small_filesystem(tmp_path / f"full-{uuid.uuid4().hex[:6]}", 2) as mnt:
        yield mnt


def _torch_save(d, nbytes):  # DeepSpeed's checkpoint engine: torch.save per rank file
    (d / "deepspeed").mkdir()
    torch.save({"w": torch.zeros(nbytes // 4)}, d / "deepspeed" / "rank0.pt")


def _dcp_save(d, nbytes):  # FSDP2's: torch.distributed.checkpoint (one process, no group)
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving as one process"
        dcp.save({"w": torch.zeros(nbytes // 4)}, checkpoint_id=str(d / "fsdp"))


@pytest.mark.parametrize("shards", [_torch_save, _dcp_save], ids=["torch.save", "dcp.save"])
def test_shards_on_a_full_disk_are_a_counted_checkpoint_failure(small_tmpfs, shards):
    run = small_tmpfs / "run"
    done = []

    async def main():
        w = CheckpointWriter(run, keep=1)
        small = lambda d: shards(d, 64 << 10)  # noqa: E731
        big = lambda d: shards(d, 3 << 20)  # noqa: E731 (more than the 2 MiB disk)
        assert await w.save(LearnerState(step=1), lambda: {"s": torch.ones(3)}, b"one",
                            done.append, shards=small) is not None
        # The disk fills during the rank files' write: save returns (no exception) ...
        assert await w.save(LearnerState(step=2), lambda: {"s": torch.ones(3)}, b"two",
                            done.append, shards=big) is not None
        return w

    w = asyncio.run(main())
    # ... and the failure is counted and handed over once, in one line.
    assert w.failures == 1
    e = w.take_error()
    assert isinstance(e, CheckpointError) and w.take_error() is None
    assert "step 2" in str(e) and "step_1 is intact" in str(e) and "\n" not in str(e)
    assert [p.name for p in done] == ["step_1"]
    assert latest_checkpoint(run).name == "step_1"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["LATEST", "step_1"]


def test_an_interrupt_during_a_save_is_not_taken_for_a_failed_write(tmp_path):
    """KeyboardInterrupt passes as it is (the partial directory still goes)."""
    def stop(_d):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, LearnerState(step=1), {"s": torch.ones(1)}, b"", shards=stop)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_the_end_of_the_run_releases_everything_whatever_the_final_checkpoint_raises(
        tiny_model, tmp_path):
    """A real Learner (tiny model, real sockets) stopped while it waits for its first batch,
    then stopped again during its final checkpoint (a CancelledError, as a second SIGTERM
    delivers; a test double for a slow final checkpoint, named so, holds it open): the run
    still closes its sockets (the address binds again) and its metrics file, and removes its
    snapshot directory."""
    from learner_fakes import make_learner

    from buffer.transport import LearnerEndpoint

    lr = make_learner(tmp_path, tiny_model, **{"train.steps": 5})
    started = asyncio.Event()
    real = lr.checkpoint

    async def slow_final_checkpoint(final=False):  # test double: a long final write
        started.set()
        await asyncio.sleep(60)
        return await real(final=final)

    lr.checkpoint = slow_final_checkpoint

    async def main():
        task = asyncio.create_task(lr.run())
        await asyncio.sleep(1.0)  # waiting for a batch
        task.cancel()  # the first stop: the final checkpoint begins
        await asyncio.wait_for(started.wait(), 60)
        task.cancel()  # the second stop, during it
        with pytest.raises(asyncio.CancelledError):
            await task
        LearnerEndpoint(lr.cfg.bind_addr).close()  # the learner's address is free again

    asyncio.run(main())
    assert lr.metrics._file is None
    assert not lr.snapshot_dir.exists()
