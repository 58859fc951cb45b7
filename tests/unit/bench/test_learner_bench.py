"""bench.learner_bench --processes: the call goes on past a failed or out-of-memory variant,
shares --budget among the variants in order (a variant without enough left is listed as not
run), writes its table after every variant, and counts MFU over every rank's GPU (the variants
themselves are replaced: pure bookkeeping; tests/e2e/test_fsdp2.py runs the learner)."""

from __future__ import annotations

import json

import bench.learner_bench as lb


def test_failures_are_rows_and_the_budget_is_shared_in_order(monkeypatch, tmp_path):
    model = tmp_path / "model"  # a config.json is all the parent reads (FLOPs, vocabulary)
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 256,
        "vocab_size": 260}))
    ran = []

    def fake(args, name, timeout):
        ran.append((name, timeout))
        if name == "zero3-fp32-rows4":
            return {"variant": name, "error": "out of memory", "wall_s": 3.0}
        peaks = [{"alloc_gb": 1.0, "reserved_gb": 2.5 + r, "init_s": 1.0} for r in range(2)]
        return {"variant": name, "step_s": [2.0, 2.0], "step_s_mean": 2.0, "init_s": 1.0,
                "wall_s": 3.0, "peaks": peaks}

    clock = [0.0, 0.0, 100.0, 140.0, 190.0]  # start, then before each variant

    def monotonic() -> float:
        return clock.pop(0) if len(clock) > 1 else clock[0]

    monkeypatch.setattr(lb, "clock", monotonic)
    monkeypatch.setattr(lb, "measure_dist", fake)
    monkeypatch.setattr(lb, "peak_gpu_flops", lambda: ("NVIDIA H200", 989e12))
    out = tmp_path / "out"
    assert lb.main(["--size", str(model), "--processes", "2", "--variants",
                    "zero3-rows4,zero3-fp32-rows4,fsdp2-rows4,fsdp2-packed-4k", "--budget",
                    "200", "--variant-timeout", "150", "--min-variant-s", "30",
                    "--out", str(out)]) == 0
    # 200 s: 150 (capped), 100 left, 60 left, then 10 left: under --min-variant-s, not run.
    assert ran == [("zero3-rows4", 150), ("zero3-fp32-rows4", 100), ("fsdp2-rows4", 60)]
    rows = {r["variant"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert rows["zero3-fp32-rows4"]["error"] == "out of memory"
    assert rows["fsdp2-packed-4k"]["error"].startswith("not run: 10 s left")
    r = rows["fsdp2-rows4"]
    assert r["mfu"] == r["tflops"] * 1e12 / (2 * 989e12)  # over both GPUs
    table = (out / "results.md").read_text()
    assert "| zero3-fp32-rows4 | ZeRO-3, fp32 weights + autocast | micro_batch=4 | out of memory" \
        in table
    assert "| 2.5 / 3.5 |" in table  # peak reserved GB of each rank


def test_failure_names_the_cause_from_the_log():
    oom = "rank 1: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert lb.failure("a\n" + oom + "\nb", 150) == "out of memory"
    assert lb.failure("x\n[learner_bench] killed after 150 s\n", 150) == "over 150 s"
    assert lb.failure("ok\nValueError: train.fsdp2: bad\nexit 1", 150) == \
        "ValueError: train.fsdp2: bad"
    assert lb.failure("", 150) == "failed"
