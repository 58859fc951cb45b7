"""The free-space check of a fresh run in a run_dir that holds an earlier run: that run is set
aside on the same disk and keeps its bytes, so its checkpoints are not this run's. A real
filesystem (a 16 MiB tmpfs) holding an earlier run with two checkpoints of the tiny model's
size: a fresh run that needs room for three more is refused in one line (exit 2) before
anything is moved; ``--resume`` of that run (its checkpoints are its own, removed as it writes)
is not refused by the check. The launcher's own refusal (``pipeline-train``, in this process)
comes before the earlier run is moved or any process started."""

from __future__ import annotations

import json
import shutil
import uuid

import pytest

from pipeline.config import load_config
from pipeline.launch.local import check_fresh_run_space
from pipeline.learner.disk import check_run_space, estimate_checkpoint_bytes
from pipeline.memory import model_parameters
from pipeline.options import ConfigError
from tests.small_fs import small_filesystem


@pytest.fixture
def tmpfs_16m(tmp_path):
    with small_filesystem(tmp_path / f"disk-{uuid.uuid4().hex[:6]}", 16) as mnt:
        yield mnt


def test_an_earlier_runs_checkpoints_are_not_counted_for_a_fresh_run(tmpfs_16m, tiny_model):
    hf = json.loads((tiny_model / "config.json").read_text())
    each = estimate_checkpoint_bytes(model_parameters(hf), model_parameters(hf))
    run = tmpfs_16m / "run"
    for step in (1, 2):  # the earlier run: two checkpoints of this model's size, then its end
        d = run / "checkpoints" / f"step_{step}"
        d.mkdir(parents=True)
        (d / "tensors-00000.safetensors").write_bytes(b"\0" * each)
    (run / "checkpoints" / "LATEST").write_text("step_2")
    (run / "metrics.jsonl").write_text('{"step": 2}\n')
    free = shutil.disk_usage(tmpfs_16m).free
    assert each <= free < 3 * each, (each, free)  # fits one more, not keep 2 + 1
    cfg = load_config(overrides={"model.path": str(tiny_model), "data.path": "arithmetic:10",
                                 "run_dir": str(run), "train.keep_checkpoints": 2,
                                 "train.checkpoint_every": 1})
    # The check before any process starts counts them as written (it cannot tell a fresh run):
    assert check_run_space(cfg, str(tiny_model)) is None
    # The launcher's for a fresh run does not: one line, and the earlier run is not moved yet.
    with pytest.raises(ConfigError) as e:
        check_fresh_run_space(cfg, str(tiny_model), resume=False)
    assert "\n" not in str(e.value) and "train.keep_checkpoints 2" in str(e.value)
    assert f"{3 * each} bytes" in str(e.value)
    assert (run / "checkpoints" / "step_2").is_dir() and (run / "metrics.jsonl").is_file()
    check_fresh_run_space(cfg, str(tiny_model), resume=True)  # --resume: they are its own


def test_pipeline_train_refuses_a_fresh_run_beside_an_earlier_runs_checkpoints(tmpfs_16m,
                                                                               tiny_model,
                                                                               capsys):
    from pipeline.launch.cli import main

    hf = json.loads((tiny_model / "config.json").read_text())
    each = estimate_checkpoint_bytes(model_parameters(hf), model_parameters(hf))
    run = tmpfs_16m / "run"
    for step in (1, 2):
        d = run / "checkpoints" / f"step_{step}"
        d.mkdir(parents=True)
        (d / "tensors-00000.safetensors").write_bytes(b"\0" * each)
    (run / "checkpoints" / "LATEST").write_text("step_2")
    (run / "metrics.jsonl").write_text('{"step": 2}\n')
    code = main(["--model", str(tiny_model), "--data", "arithmetic:10", "--run-dir", str(run),
                 "--train.keep_checkpoints", "2", "--train.checkpoint_every", "1",
                 "--tensorboard", "false", "--progress", "false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "train.keep_checkpoints 2" in err[0], err
    assert sorted(p.name for p in tmpfs_16m.iterdir()) == ["run"]  # nothing moved aside
