"""bench/trl_grpo.py: argument checks, the GRPOConfig it builds, and its JSON summary (pure logic;
no training). The one test that builds a real GRPOConfig is skipped where trl is not installed
(it is only in the optional `bench` extra)."""

from __future__ import annotations

import importlib.util

import pytest

from bench.trl_grpo import (
    P_PREPARE,
    P_SYNC,
    Recorder,
    arithmetic_dataset_rows,
    build_parser,
    exact_match_reward,
    grpo_config_kwargs,
    summarize,
    validate_args,
)
from bench.trl_runner import default_micro_batch, server_command


def _args(*extra: str):
    args = build_parser().parse_args(["--model", "/m", "--out", "/tmp/x.json", *extra])
    validate_args(args)
    return args


def test_micro_batch_defaults_to_the_largest_divisor_up_to_16():
    assert default_micro_batch(64) == 16
    assert default_micro_batch(24) == 12
    assert default_micro_batch(6) == 6
    assert _args("--batch-groups", "3", "--group-size", "8").micro_batch == 12


@pytest.mark.parametrize("extra, match", [
    (["--micro-batch", "5"], "must divide"),
    (["--group-size", "1"], "group-size"),
    (["--steps", "0"], "--steps"),
    (["--max-tokens", "1024"], "max-model-len"),
    (["--vllm-mode", "server", "--vllm-enable-sleep-mode"], "colocate only"),
    (["--vllm-gpu-memory-utilization", "0"], "utilization"),
])
def test_bad_settings_name_the_option(extra, match):
    args = build_parser().parse_args(["--model", "/m", "--out", "/o.json", *extra])
    with pytest.raises(ValueError, match=match):
        validate_args(args)


def test_one_generation_batch_is_one_on_policy_optimiser_step():
    args = _args("--batch-groups", "8", "--group-size", "8", "--lr", "3e-6")
    kw = grpo_config_kwargs(args, cuda=True, output_dir="/w")
    assert kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"] == 64
    assert kw["num_generations"] == 8 and kw["num_iterations"] == 1
    assert kw["learning_rate"] == 3e-6 and kw["lr_scheduler_type"] == "constant"
    assert kw["beta"] == 0.0 and (kw["epsilon"], kw["epsilon_high"]) == (0.2, 0.28)
    assert kw["bf16"] and not kw["use_cpu"] and kw["model_init_kwargs"] == {"dtype": "float32"}
    assert kw["use_vllm"] and kw["vllm_mode"] == "colocate"
    assert kw["generation_kwargs"] is None
    assert not grpo_config_kwargs(args, cuda=False, output_dir="/w")["bf16"]


def test_ignore_eos_maps_to_each_backend():
    vllm = grpo_config_kwargs(_args("--ignore-eos", "--max-tokens", "32"), cuda=True,
                              output_dir="/w")
    assert vllm["generation_kwargs"] == {"ignore_eos": True}
    hf = grpo_config_kwargs(_args("--ignore-eos", "--max-tokens", "32", "--vllm-mode", "none"),
                            cuda=False, output_dir="/w")
    assert hf["generation_kwargs"] == {"min_new_tokens": 32} and not hf["use_vllm"]


def test_server_mode_points_the_trainer_at_the_server_it_starts():
    args = _args("--vllm-mode", "server", "--server-port", "8123", "--enforce-eager")
    kw = grpo_config_kwargs(args, cuda=True, output_dir="/w")
    assert kw["vllm_mode"] == "server"
    assert kw["vllm_server_base_url"] == "http://127.0.0.1:8123"
    assert args.vllm_gpu_memory_utilization == 0.9   # a dedicated GPU (TRL's default)
    assert _args().vllm_gpu_memory_utilization == 0.3   # colocate: a share of the trainer's
    cmd = server_command(args, python="py")
    assert cmd[:3] == ["py", "-m", "trl.scripts.vllm_serve"]
    assert cmd[cmd.index("--port") + 1] == "8123" and "--enforce_eager" in cmd


def test_prompts_are_our_arithmetic_records_and_the_reward_reads_messages():
    chat = arithmetic_dataset_rows(4, 20, chat=True)
    plain = arithmetic_dataset_rows(4, 20, chat=False)
    assert chat[0]["prompt"] == [{"role": "user", "content": plain[0]["prompt"]}]
    assert plain[0]["prompt"].startswith("What is ") and chat[0]["prompt_id"] == "arith-1234-0"
    answer = chat[0]["answer"]
    completions = [[{"role": "assistant", "content": f"= {answer}"}],
                   [{"role": "assistant", "content": "no idea"}]]
    assert exact_match_reward([chat[0]["prompt"]] * 2, completions, [answer] * 2) == [1.0, 0.0]


def _recorder() -> Recorder:
    rec = Recorder(t0=0.0, unix0=1000.0)
    rec.train_begin = 10.0
    rec.step_end = {1: 14.0, 2: 16.0, 3: 18.0}
    rec.logs = {s: {"reward": str(0.1 * s), "completions/mean_length": "16", "loss": "0.5"}
                for s in (1, 2, 3)}
    for s in (1, 2, 3):
        rec.prof[s][P_PREPARE] = 1.5
        rec.prof[s]["GRPOTrainer.vLLM.generate"] = 1.0
        rec.prof[s][P_SYNC] = 0.25
    return rec


def test_summary_per_step_rows_throughput_and_weight_sync():
    out = summarize(_recorder(), steps=3, samples_per_step=8, max_tokens=16, ignore_eos=True)
    assert out["steps_done"] == 3 and out["startup_s"] == 10.0 and out["train_wall_s"] == 8.0
    rows = out["per_step"]
    assert [r["step_time_s"] for r in rows] == [4.0, 2.0, 2.0]
    assert rows[0]["reward"] == pytest.approx(0.1) and rows[2]["unix_time"] == 1018.0
    assert rows[0]["completion_tokens"] == 128 and rows[1]["train_s"] == pytest.approx(0.5)
    assert out["throughput"]["trained_samples_per_s"] == pytest.approx(24 / 8.0)
    assert out["throughput"]["completion_tokens_per_s"] == pytest.approx(384 / 8.0)
    assert out["throughput_after_first_step"]["trained_samples_per_s"] == pytest.approx(4.0)
    assert out["weight_sync"]["mean_s"] == 0.25
    assert out["time_split"]["generate_s"] == pytest.approx(3.0)
    # the rows bench/gpu_bench.py reads
    assert out["steps"][1] == {"step": 2, "ts": 1016.0, "step_s": 2.0, "trained_tokens": 128,
                               "reward_mean": pytest.approx(0.2), "sync_s": 0.25,
                               "generate_s": 1.0, "train_s": pytest.approx(0.5)}


def test_summary_of_a_run_without_vllm_or_finished_steps():
    rec = _recorder()
    for s in rec.prof:
        rec.prof[s].pop(P_SYNC)
    rec.step_end.pop(3)
    out = summarize(rec, steps=3, samples_per_step=8, max_tokens=16, ignore_eos=False)
    assert out["steps_done"] == 2
    assert out["weight_sync"]["mean_s"] is None and "no weight sync" in out["weight_sync"]["note"]
    empty = summarize(Recorder(), steps=3, samples_per_step=8, max_tokens=16, ignore_eos=False)
    assert empty["steps_done"] == 0 and empty["throughput"]["trained_samples_per_s"] is None


@pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                    reason="trl is not installed (optional extra: pip install -e '.[bench]')")
def test_trl_accepts_the_config_and_keeps_one_generation_per_step(tmp_path):
    from trl import GRPOConfig

    args = _args("--batch-groups", "4", "--group-size", "4", "--vllm-mode", "none")
    cfg = GRPOConfig(**grpo_config_kwargs(args, cuda=False, output_dir=str(tmp_path)))
    assert cfg.generation_batch_size == 16
    assert cfg.steps_per_generation == cfg.gradient_accumulation_steps


def test_trainer_gpus_may_not_overlap_the_server_it_starts():
    assert _args("--vllm-mode", "server", "--trainer-gpus", "0").trainer_gpus == "0"
    assert _args().trainer_gpus is None  # inherited unless given
    args = build_parser().parse_args(["--model", "/m", "--out", "/o.json", "--vllm-mode",
                                      "server", "--trainer-gpus", "0,1"])
    with pytest.raises(ValueError, match="overlap"):
        validate_args(args)
    # an external server (--server-url) is not on our GPUs' list
    assert _args("--vllm-mode", "server", "--trainer-gpus", "1",
                 "--server-url", "http://h:8000").trainer_gpus == "1"
