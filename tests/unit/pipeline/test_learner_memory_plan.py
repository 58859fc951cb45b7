"""The learner's memory plan (pipeline.memory_plan): pure choices on the benchmark shapes of one
80 GB card, the user's values kept (a warning when they will not fit), and the plan applied to a
RunConfig from a model's config.json with a given card (no GPU needed)."""

from __future__ import annotations

import json

import pytest

from bench.gpu_model import SIZES
from pipeline.config import load_config
from pipeline.memory_plan import (
    CEILING,
    TARGET,
    Job,
    Options,
    Shape,
    activation_bytes,
    apply_memory_plan,
    choose,
    state_bytes,
    warnings,
)

CARD = 81559 * 2**20  # an H100 80GB HBM3 as nvidia-smi reports it
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _shape(size: str) -> Shape:
    return Shape.from_hf({**SIZES[size], "model_type": "qwen2"})


def _job(**over) -> Job:
    base = dict(card=CARD, engines=1, engine_share=0.3, longest=1024, batch_tokens=128 * 1024,
                admitted_tokens=16 * 8 * 2 * 512, lora_targets=ALL)
    return Job(**{**base, **over})


@pytest.mark.parametrize("size,lora", [("0.5b", 0), ("1.5b", 0), ("3b", 0), ("7b", 16)])
def test_benchmark_sizes_fit_one_80gb_card_by_default(size, lora):
    plan = choose(_shape(size), _job(lora_rank=lora), Options())
    assert plan.fits and plan.peak <= TARGET * CARD
    assert plan.micro_batch_tokens >= 4096 and plan.logprob_chunk >= 512
    assert plan.expandable_segments == (not lora)  # a full fine-tune's fragments


def test_3b_full_on_fixed_blocks_fits_no_target_and_says_so_in_one_line():
    """Without expandable segments the allocator's share measured at 3B (gradients and bf16
    copies re-allocated every step) keeps the leanest plan above TARGET: the cheapest one below
    CEILING runs, and the console says what would fit."""
    plan = choose(_shape("3b"), _job(), Options(expandable_segments=False))
    assert not plan.fits and plan.peak <= CEILING * CARD
    lines = warnings(plan, Options())
    assert len(lines) == 1 and "--train.lora_rank 16" in lines[0]


def test_options_are_spent_cheapest_first():
    small = choose(_shape("0.5b"), _job(), Options())
    assert (small.gradient_checkpointing, small.optimizer_state, small.host_copies,
            small.engine_share) == (False, "fp32", False, 0.3)
    mid = choose(_shape("1.5b"), _job(), Options())
    assert mid.gradient_checkpointing and mid.optimizer_state == "fp32"
    big = choose(_shape("3b"), _job(), Options())
    assert big.optimizer_state == "bf16" and big.host_copies and big.engine_share < 0.3
    assert big.parts["engine_copies"] > 0 and mid.parts["engine_copies"] == 0


def test_lora_never_changes_the_optimiser_state_or_the_copies():
    plan = choose(_shape("7b"), _job(lora_rank=16), Options())
    assert plan.optimizer_state == "fp32" and not plan.host_copies


def test_user_values_are_kept_and_one_that_does_not_fit_is_named():
    fixed = Options(micro_batch_tokens=65536, gradient_checkpointing=False)
    plan = choose(_shape("1.5b"), _job(), fixed)
    assert plan.micro_batch_tokens == 65536 and not plan.gradient_checkpointing
    assert not plan.fits
    lines = warnings(plan, fixed)
    assert len(lines) == 1 and "train.micro_batch_tokens 65536 will not fit" in lines[0]
    assert "train.gradient_checkpointing False" in lines[0]
    assert f"{plan.peak / 1e9:.1f} GB" in lines[0]


def test_the_model_state_and_activations_scale_as_the_docstrings_say():
    s = _shape("1.5b")
    assert state_bytes(s, _job(), "fp32") == 18 * s.params  # 4 + 4 + 8 + 2 (autocast copies)
    assert state_bytes(s, _job(), "bf16") == 14 * s.params
    full = activation_bytes(s, 8192, False, 1024, False)
    ckpt = activation_bytes(s, 8192, True, 1024, False)
    assert ckpt < full / 5
    assert activation_bytes(s, 16384, True, 1024, False) > ckpt


def _model_dir(tmp_path, size):
    d = tmp_path / size
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**SIZES[size], "model_type": "qwen2"}))
    return d


def _run_cfg(tmp_path, **over):
    base = {"model.path": "tiny", "data.path": "arithmetic:10", "run_dir": str(tmp_path / "r"),
            "train.batch_groups": 16, "generation.group_size": 8, "generation.max_tokens": 256,
            "learner_gpus": "0", "producer_gpus": ["0"]}
    return load_config(overrides={**base, **over})


def test_apply_memory_plan_sets_the_options_and_says_it_in_one_line(tmp_path):
    cfg = _run_cfg(tmp_path)
    planned, plan, lines = apply_memory_plan(cfg, str(_model_dir(tmp_path, "3b")),
                                             gpus={"0": CARD}, env={})
    assert plan is not None and len(lines) == 1 + (not plan.fits)
    assert lines[0].startswith("memory plan: learner peak") and lines[0].endswith("(GPU 0)")
    t = planned.train
    assert (t.gradient_checkpointing, t.micro_batch_tokens, t.logprob_chunk,
            t.optimizer_state) == (plan.gradient_checkpointing, plan.micro_batch_tokens,
                                   plan.logprob_chunk, "bf16")
    assert planned.sync.host_copies and planned.engine.gpu_memory_utilization < 0.3
    assert cfg.train.optimizer_state == "auto"  # the config passed in is not modified


def test_apply_memory_plan_keeps_a_set_value_and_warns_once(tmp_path):
    cfg = _run_cfg(tmp_path, **{"train.micro_batch_tokens": 65536,
                                "train.gradient_checkpointing": True})
    planned, plan, lines = apply_memory_plan(cfg, str(_model_dir(tmp_path, "3b")),
                                             gpus={"0": CARD}, env={})
    assert planned.train.micro_batch_tokens == 65536
    if not plan.fits:
        assert len(lines) == 2 and "train.micro_batch_tokens 65536" in lines[1]


def test_no_plan_without_a_gpu_or_for_a_sharded_learner(tmp_path):
    cfg = _run_cfg(tmp_path)
    model = str(_model_dir(tmp_path, "1.5b"))
    assert apply_memory_plan(cfg, model, gpus={}, env={}) == (cfg, None, [])
    two = _run_cfg(tmp_path, **{"train.learner_processes": 2, "train.fsdp2": True})
    assert apply_memory_plan(two, model, gpus={"0": CARD}, env={})[1] is None
    off = _run_cfg(tmp_path, **{"launch.memory_check": False})
    assert apply_memory_plan(off, model, gpus={"0": CARD}, env={})[1] is None


def test_split_layout_counts_no_engine_on_the_learner_gpu(tmp_path):
    cfg = _run_cfg(tmp_path, learner_gpus="1", producer_gpus=["0"])
    _, plan, _ = apply_memory_plan(cfg, str(_model_dir(tmp_path, "1.5b")),
                                   gpus={"0": CARD, "1": CARD}, env={})
    assert plan is not None and plan.engines == 0
