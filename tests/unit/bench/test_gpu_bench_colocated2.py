"""bench.gpu_bench's colocated-2 layout (issue 27): a producer on each of GPUs 0 and 1 and the
learner ZeRO-3 over both (the subprocess is replaced: pure argument logic)."""

from __future__ import annotations

import json

import bench.gpu_bench as gb
from bench.gpu_bench import parse_args


def _cmd(monkeypatch, tmp_path, *argv):
    seen = {}
    monkeypatch.setattr(gb, "_timed", lambda args, name, cmd, *a, **k: seen.setdefault("cmd", cmd))
    gb.run_ours(parse_args(["--layout", "colocated-2", *argv, "--out", str(tmp_path)]), "async1",
                "/m", tmp_path)
    cmd = seen["cmd"]
    return {k: cmd[i + 1] for i, k in enumerate(cmd[:-1]) if k.startswith("--")}, cmd


def test_colocated_2_puts_a_producer_on_each_gpu_and_zero3_over_both(monkeypatch, tmp_path):
    opts, _ = _cmd(monkeypatch, tmp_path)
    assert json.loads(opts["--producer_gpus"]) == ["0", "1"]
    assert opts["--learner_gpus"] == "0,1" and opts["--num_producers"] == "2"
    assert opts["--train.learner_processes"] == "2"
    assert opts["--train.accelerate_config"].endswith("examples/accelerate/zero3.yaml")


def test_colocated_2_takes_another_accelerate_config_from_set(monkeypatch, tmp_path):
    opts, cmd = _cmd(monkeypatch, tmp_path, "--set",
                     "train.accelerate_config=examples/accelerate/zero3_offload.yaml")
    assert "--train.accelerate_config" not in opts
    assert "train.accelerate_config=examples/accelerate/zero3_offload.yaml" in cmd


def test_colocated_2_with_fsdp2_has_no_accelerate_config(monkeypatch, tmp_path):
    """train.fsdp2 refuses an accelerate config, so the ZeRO-3 default must not be added."""
    opts, cmd = _cmd(monkeypatch, tmp_path, "--set", "train.fsdp2=true")
    assert "--train.accelerate_config" not in opts and "train.fsdp2=true" in cmd
    assert opts["--train.learner_processes"] == "2"
