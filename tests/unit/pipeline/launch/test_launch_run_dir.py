"""pipeline.launch.run_dir: a fresh run never appends to an earlier one (set_aside_previous_run);
the end of a run names the groups its producers' outboxes still hold (waiting_groups_line)."""

from __future__ import annotations

import json

import numpy as np

from buffer.ledger import GroupLedger
from buffer.schema import Completion, RolloutGroup
from pipeline.launch.run_dir import set_aside_previous_run, waiting_groups_line
from pipeline.producer.outbox import Outbox


def test_earlier_run_is_moved_aside_whole(tmp_path):
    run = tmp_path / "demo"
    (run / "checkpoints" / "step_3").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    moved = set_aside_previous_run(run)
    assert moved is not None and not run.exists()
    assert moved.name.startswith("demo.prev-") and (moved / "metrics.jsonl").exists()
    assert (moved / "checkpoints" / "step_3").is_dir()
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    again = set_aside_previous_run(run)  # same second: a distinct name, nothing overwritten
    assert again is not None and again != moved and moved.exists()


def test_empty_or_missing_run_dir_stays(tmp_path):
    assert set_aside_previous_run(tmp_path / "new") is None
    (tmp_path / "cfg-only").mkdir()
    (tmp_path / "cfg-only" / "config.yaml").write_text("name: x\n")
    assert set_aside_previous_run(tmp_path / "cfg-only") is None
    assert (tmp_path / "cfg-only" / "config.yaml").exists()


def test_an_empty_checkpoints_directory_is_no_earlier_run(tmp_path):
    """It may be the mount point of the disk the user gave this run's checkpoints."""
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert set_aside_previous_run(tmp_path / "run") is None
    (tmp_path / "run" / "checkpoints" / "LATEST").write_text("step_1")
    assert set_aside_previous_run(tmp_path / "run") is not None


def _group(inc: str, seq: int, version: int) -> RolloutGroup:
    c = Completion(token_ids=np.array([1, 2], np.int32), logprobs=np.array([-1, -2], np.float32),
                   version_segments=[(0, version)], reward=1.0)
    return RolloutGroup(group_id=f"{inc}-{seq}", producer_id="p0", prompt_id=str(seq),
                        prompt_token_ids=np.array([5], np.int32), completions=[c, c],
                        metadata={"incarnation": inc, "seq": seq})


def _checkpoint(run, version: int, ledger: GroupLedger) -> None:
    step = run / "checkpoints" / f"step_{version}"
    step.mkdir(parents=True)
    (step / "state.json").write_text(json.dumps({"step": version, "version": version,
                                                 "ledger": ledger.to_dict()}))
    (run / "checkpoints" / "LATEST").write_text(step.name)


def test_the_end_of_a_run_names_groups_left_in_a_killed_producers_outbox(tmp_path):
    """A producer killed late: its successor was still starting when the learner finished, so
    the groups its predecessor generated stay in its outbox. The run says how many wait where,
    and which of them --resume could still train within train.max_staleness."""
    run = tmp_path / "run"
    killed = Outbox(run / "producers", "p0", "p0-11", max_groups=100)
    for seq, version in enumerate([3, 4, 6, 6]):
        killed.add(_group("p0-11", seq, version))
    ledger = GroupLedger()
    ledger.accept("p0-11", 0)
    _checkpoint(run, 6, ledger)
    line = waiting_groups_line(run, max_staleness=1)
    assert line == (f"pipeline-train: 3 group(s) generated but not delivered wait in "
                    f"{run / 'producers'}/ (p0-11.wal: 3); --resume with a larger --steps "
                    "trains 2 of them (the other 1: dropped, older than train.max_staleness "
                    "allows)")
    assert waiting_groups_line(run, max_staleness=2).endswith("--steps trains them")
    for seq in (1, 2, 3):
        ledger.accept("p0-11", seq)
    (run / "checkpoints" / "step_6" / "state.json").write_text(json.dumps(
        {"step": 6, "version": 6, "ledger": ledger.to_dict()}))
    assert waiting_groups_line(run, max_staleness=1) is None  # all delivered: nothing to say


def test_without_a_checkpoint_every_group_in_an_outbox_waits(tmp_path):
    run = tmp_path / "run"
    box = Outbox(run / "producers", "p1", "p1-7", max_groups=100)
    box.add(_group("p1-7", 0, 0))
    box.close()
    assert waiting_groups_line(run, max_staleness=0).startswith(
        "pipeline-train: 1 group(s) generated but not delivered wait in ")
    assert waiting_groups_line(tmp_path / "empty", max_staleness=0) is None


def test_the_dedicated_evaluator_is_the_engine_after_the_producers(tmp_path):
    """Its index (num_producers) starts the evaluator, logging to logs/evaluator.log; a shared
    run has no such engine."""
    from pipeline.config import load_config
    from pipeline.options import to_dict
    from pipeline.schedule import display_name, is_evaluator, process_name

    over = {"run_dir": str(tmp_path), "num_producers": 2, "train.batch_groups": 4,
            "eval.data": "arithmetic:8", "eval.every": 1}
    dedicated = to_dict(load_config(overrides={**over, "eval.producer": "dedicated"}))
    assert [process_name(dedicated, i) for i in range(3)] == \
        ["producer-0", "producer-1", "evaluator"]
    # Console lines ("producer 1 died ...") say it with a space.
    assert [display_name(dedicated, i) for i in range(3)] == \
        ["producer 0", "producer 1", "evaluator"]
    shared = to_dict(load_config(overrides=over))
    assert not any(is_evaluator(shared, i) for i in range(3))


def test_a_fresh_launch_drops_an_earlier_roster_and_a_resumed_one_keeps_its_leases(tmp_path):
    """A stale roster.json (a run stopped before any metrics) would name producers this run
    does not start; --resume keeps the leases but starts with this launch's producers."""
    from pipeline.launch.run_dir import roster_for_launch
    from pipeline.learner.roster import ROSTER_FILE, Roster

    roster = Roster(2, chunk=4, path=tmp_path / ROSTER_FILE)
    roster.top_up({})
    roster.save()
    roster_for_launch(tmp_path, resume=True, num_producers=1)
    again = Roster.open(tmp_path, 1, chunk=4)
    assert list(again.members) == ["p0"] and again.pool == [[4, 8]]
    roster_for_launch(tmp_path, resume=False, num_producers=1)
    assert not (tmp_path / ROSTER_FILE).exists()
