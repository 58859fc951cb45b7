"""Outbox: unconfirmed groups survive a learner restart (memory) and a producer kill (log file)."""

from __future__ import annotations

import numpy as np

from buffer.ledger import GroupLedger
from buffer.schema import Completion, RolloutGroup
from pipeline.producer import outbox as outbox_mod
from pipeline.producer.outbox import Outbox, read_log, undelivered


def _group(inc: str, seq: int, version: int = 0) -> RolloutGroup:
    c = Completion(token_ids=np.array([1, 2], np.int32), logprobs=np.array([-1, -2], np.float32),
                   version_segments=[(0, version)], reward=1.0)
    return RolloutGroup(group_id=f"{inc}-{seq}", producer_id="p0", prompt_id=str(seq),
                        prompt_token_ids=np.array([5], np.int32), completions=[c, c],
                        metadata={"incarnation": inc, "seq": seq})


def test_durable_groups_are_forgotten_the_rest_resent(tmp_path):
    box = Outbox(tmp_path, "p0", "p0-1", max_groups=100)
    for seq in range(5):
        box.add(_group("p0-1", seq))
    box.forget_durable({"p0-1": 3})
    assert [g.metadata["seq"] for g in box.unconfirmed()] == [3, 4]
    assert [g.group_id for g in read_log(tmp_path / "p0-1.wal")] == [f"p0-1-{i}" for i in range(5)]


def test_a_new_process_recovers_a_killed_ones_log_and_deletes_it_once_durable(tmp_path):
    dead = Outbox(tmp_path, "p0", "p0-1", max_groups=100)
    for seq in range(3):
        dead.add(_group("p0-1", seq))
    # kill -9: no close(); a torn frame at the end must be ignored
    with (tmp_path / "p0-1.wal").open("ab") as fh:
        fh.write(b"\x40\x00\x00\x00partial")
    Outbox(tmp_path, "p1", "p1-9", max_groups=100)  # another producer id takes nothing
    box = Outbox(tmp_path, "p0", "p0-2", max_groups=100)
    assert box.recovered == 3
    assert [g.group_id for g in box.unconfirmed()] == ["p0-1-0", "p0-1-1", "p0-1-2"]
    box.forget_durable({"p0-1": 3})
    assert box.unconfirmed() == [] and not (tmp_path / "p0-1.wal").exists()


def test_overflow_drops_the_oldest_and_counts(tmp_path):
    box = Outbox(tmp_path, "p0", "p0-1", max_groups=2)
    for seq in range(4):
        box.add(_group("p0-1", seq))
    assert [g.metadata["seq"] for g in box.unconfirmed()] == [2, 3]
    assert box.overflow == 2


def test_log_is_compacted_to_the_unconfirmed_groups(tmp_path, monkeypatch):
    monkeypatch.setattr(outbox_mod, "COMPACT_BYTES", 1)
    box = Outbox(tmp_path, "p0", "p0-1", max_groups=100)
    for seq in range(4):
        box.add(_group("p0-1", seq))
    box.forget_durable({"p0-1": 3})
    assert [g.metadata["seq"] for g in read_log(tmp_path / "p0-1.wal")] == [3]
    box.add(_group("p0-1", 4))
    assert [g.metadata["seq"] for g in read_log(tmp_path / "p0-1.wal")] == [3, 4]


def test_undelivered_counts_what_the_learners_ledger_lacks_per_log(tmp_path):
    """A producer killed late (p0-1) and the live one (p1-2): what their logs hold beyond the
    ledger of the learner's last checkpoint is left, with each group's policy_version."""
    dead = Outbox(tmp_path, "p0", "p0-1", max_groups=100)
    for seq in range(5):
        dead.add(_group("p0-1", seq, version=seq))
    live = Outbox(tmp_path, "p1", "p1-2", max_groups=100)
    for seq in range(3):
        live.add(_group("p1-2", seq, version=4))
    live.close()
    ledger = GroupLedger()
    for inc, seq in [("p0-1", 0), ("p0-1", 1), ("p0-1", 3), ("p1-2", 0), ("p1-2", 1),
                     ("p1-2", 2)]:
        ledger.accept(inc, seq)
    assert undelivered(tmp_path, ledger) == {"p0-1.wal": [2, 4]}
    assert undelivered(tmp_path, GroupLedger()) == {"p0-1.wal": [0, 1, 2, 3, 4],
                                                    "p1-2.wal": [4, 4, 4]}
    assert undelivered(tmp_path / "none", ledger) == {}


def test_a_full_disk_pauses_recording_once_and_resumes_by_itself(tmp_path, monkeypatch, caplog):
    """A real 1 MB filesystem (a tmpfs; needs root) filled while groups are recorded: the group
    waits in memory, none of it in the log, ``full`` is set (the producer admits nothing) with
    one warning; once the filler is gone the group goes in and ``full`` clears. Full again
    soon after: a second pause, logged but not warned of again."""
    import asyncio
    import logging

    from tests.small_fs import fill, small_filesystem

    monkeypatch.setattr(outbox_mod, "DISK_RETRY_S", 0.05)
    with small_filesystem(tmp_path / "fs", 1) as fs:
        box = Outbox(fs, "p0", "p0-1", max_groups=100)
        box.add(_group("p0-1", 0))
        fill(fs / "filler")

        async def run() -> None:
            # More than the page the log has begun holds: the last ones find no room.
            waiting = [asyncio.create_task(box.record(_group("p0-1", s))) for s in range(1, 61)]
            await asyncio.sleep(0.3)
            assert box.full and not all(t.done() for t in waiting)
            assert box.full_pauses == 1
            (fs / "filler").unlink()
            await asyncio.wait_for(asyncio.gather(*waiting), 5)
            assert not box.full and box.full_s > 0.2
            fill(fs / "filler")  # full again soon after: counted, not told again
            again = [asyncio.create_task(box.record(_group("p0-1", s))) for s in range(61, 121)]
            await asyncio.sleep(0.3)
            assert box.full and box.full_pauses == 2
            (fs / "filler").unlink()
            await asyncio.wait_for(asyncio.gather(*again), 5)

        with caplog.at_level(logging.INFO, logger="pipeline.producer.outbox"):
            asyncio.run(run())
        box.close()
        groups = read_log(fs / "p0-1.wal")
        assert sorted(g.metadata["seq"] for g in groups) == list(range(121))  # none torn
        warned = [r for r in caplog.records if outbox_mod.DISK_FULL in r.getMessage()]
        assert [r.levelname for r in warned] == ["WARNING", "INFO"]  # the console's: one
