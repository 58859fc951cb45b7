"""bench.gpu_bench's colocated-2 layout (the 7B path): a producer on each of GPUs 0 and 1 and the
learner sharded over both, FSDP2 with packed, checkpointed 8k-token micro-batches and an engine
share of 0.15 unless ``--set``/``--gpu-mem`` say otherwise (the subprocess is replaced: pure
argument logic)."""

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


def _sets(cmd):
    return [cmd[i + 1] for i, k in enumerate(cmd[:-1]) if k == "--set"]


def test_colocated_2_puts_a_producer_on_each_gpu_and_fsdp2_over_both(monkeypatch, tmp_path):
    opts, cmd = _cmd(monkeypatch, tmp_path)
    assert json.loads(opts["--producer_gpus"]) == ["0", "1"]
    assert opts["--learner_gpus"] == "0,1" and opts["--num_producers"] == "2"
    assert opts["--train.learner_processes"] == "2"
    assert "--train.accelerate_config" not in opts
    assert _sets(cmd) == ["train.fsdp2=true", "train.packing=true",
                          "train.micro_batch_tokens=8192", "train.gradient_checkpointing=true"]
    assert opts["--engine.gpu_memory_utilization"] == "0.15"


def test_colocated_2_keeps_the_measured_command_as_it_was(monkeypatch, tmp_path):
    """BENCHMARKS.md's 7B row names every setting with --set: each appears once."""
    _opts, cmd = _cmd(monkeypatch, tmp_path, "--gpu-mem", "0.25",
                      *[a for kv in gb.SHARDED_LEARNER for a in ("--set", kv)],
                      "--set", "train.keep_checkpoints=1")
    sets = _sets(cmd)
    assert sorted(sets) == sorted([*gb.SHARDED_LEARNER, "train.keep_checkpoints=1"])


def test_colocated_2_takes_another_accelerate_config_from_set(monkeypatch, tmp_path):
    opts, cmd = _cmd(monkeypatch, tmp_path, "--set",
                     "train.accelerate_config=examples/accelerate/zero3_offload.yaml")
    assert "--train.accelerate_config" not in opts
    assert "train.accelerate_config=examples/accelerate/zero3_offload.yaml" in cmd
    assert not any(s.startswith("train.fsdp2") for s in _sets(cmd))  # FSDP2 refuses a config
    assert "train.packing=true" in _sets(cmd)  # the same micro-batches under ZeRO-3


def test_colocated_2_with_fsdp2_false_runs_zero3(monkeypatch, tmp_path):
    opts, cmd = _cmd(monkeypatch, tmp_path, "--set", "train.fsdp2=false",
                     "--set", "train.micro_batch_tokens=32768", "--gpu-mem", "0.2")
    assert opts["--train.accelerate_config"].endswith("examples/accelerate/zero3.yaml")
    sets = _sets(cmd)
    assert sets.count("train.fsdp2=false") == 1 and "train.fsdp2=true" not in sets
    assert [s for s in sets if s.startswith("train.micro_batch_tokens")] == [
        "train.micro_batch_tokens=32768"]
    assert opts["--engine.gpu_memory_utilization"] == "0.2"


def test_other_layouts_keep_their_engine_share(monkeypatch, tmp_path):
    assert parse_args(["--layout", "split", "--out", str(tmp_path)]).gpu_mem == 0.5


def test_the_peak_gpu_memory_of_a_run_is_in_its_result():
    """The sampler's highest bytes in use per GPU go into results.json (GB), for the run's GPUs."""
    rows = [{"ts": float(i), "step_s": 1.0, "trained_tokens": 10.0} for i in range(5)]

    class Sampler:
        def __init__(self):
            self.mem_peak = {0: 127.3e9, 1: 126.0e9, 2: 5e9}

        def busy(self, gpu, t0, t1):
            return 0.9

    res = gb.summarize("async1", rows, 5.0, 1, 8, Sampler(),
                       {"generation": [0, 1], "learner": [0, 1]})
    assert res.gpu_mem_peak_gb == {"0": 127.3, "1": 126.0}
