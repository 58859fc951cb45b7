"""bench.checkpoint_runs: the table of two gpu_bench outputs (without and with a checkpoint every
step), read from the files gpu_bench and the learner write."""

from __future__ import annotations

import json

from bench.checkpoint_runs import table


def _out(root, name, samples, metrics=()):
    out = root / name
    (out / "async1").mkdir(parents=True)
    (out / "results.json").write_text(json.dumps(
        {"results": [{"name": "async1", "ok": True, "samples_per_s": samples}]}))
    (out / "async1" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return out


def test_ratio_stalls_and_counts_of_the_checkpointing_run(tmp_path):
    none = _out(tmp_path, "none", 50.0)
    every = _out(tmp_path, "every1", 48.0, [
        {"step": 1, "checkpoint_stall_s": 0.4, "checkpoints_skipped": 0.0},
        {"step": 2, "checkpoint_stall_s": 0.0, "checkpoints_skipped": 1.0},  # skipped
        {"step": 3, "checkpoint_stall_s": 0.1, "checkpoint_write_s": 5.0,
         "checkpoint_write_gbps": 3.5, "checkpoints_skipped": 1.0, "checkpoint_failures": 0.0},
    ])
    row = table(none, every).splitlines()[2]
    assert row == "| 50.00 | 48.00 | 0.96 | 0.400 (0.400) | 0.250 | 1 | 1 | 0 | 3.50 |"


def test_a_missing_run_is_n_a(tmp_path):
    none = _out(tmp_path, "none", 50.0)
    row = table(none, tmp_path / "absent").splitlines()[2]
    assert row.startswith("| 50.00 | n/a | n/a | n/a (n/a) | n/a | 0 | 0 | 0 | n/a |")


def test_each_stall_in_its_parts(tmp_path):
    from bench.checkpoint_runs import parts_table

    every = _out(tmp_path, "every1", 48.0, [
        {"step": 1, "checkpoint_stall_s": 1.5, "checkpoint_thread_wait_s": 0.0,
         "checkpoint_state_s": 1.2, "checkpoint_copy_start_s": 0.25, "checkpoint_resume_s": 0.05},
        {"step": 2, "checkpoint_stall_s": 0.0},  # skipped: no row
        {"step": 3, "checkpoint_stall_s": 0.2},  # written before the parts were recorded
    ])
    lines = parts_table(every).splitlines()
    assert lines[0] == "| step | stall s | thread_wait s | state s | copy_start s | resume s |"
    assert lines[2:] == ["| 1 | 1.500 | 0.000 | 1.200 | 0.250 | 0.050 |",
                         "| 3 | 0.200 | n/a | n/a | n/a | n/a |"]
