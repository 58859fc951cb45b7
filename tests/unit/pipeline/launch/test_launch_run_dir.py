"""pipeline.launch.local.set_aside_previous_run: a fresh run never appends to an earlier one."""

from __future__ import annotations

from pipeline.launch.local import set_aside_previous_run


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
