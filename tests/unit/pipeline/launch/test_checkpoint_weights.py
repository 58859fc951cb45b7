"""Reading any checkpoint for ``pipeline-train eval`` (``pipeline.launch.checkpoint_weights``):
the kind is told from the checkpoint, LoRA is merged exactly as peft merges it, DeepSpeed
partitions go through zero_to_fp32 (a fake here; the real one runs in
tests/e2e/test_eval_checkpoints.py), and a checkpoint that is unreadable or another model's is
refused in one line, exit 2, before any engine starts."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.launch import evaluation
from pipeline.launch.checkpoint_weights import (
    check_fits_model,
    checkpoint_kind,
    checkpoint_weights,
    engine_weights,
    lora_scales,
)
from pipeline.learner.checkpoint import CheckpointError, LearnerState, save_checkpoint
from pipeline.models import build_tiny_model
from sync.snapshot import model_manifest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def _hf_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _lora_model(model_dir: Path, r: int = 4, alpha: float = 8.0):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha,
                                             target_modules=["q_proj", "v_proj", "down_proj"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained adapter: lora_B is no longer zero
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _save(run_dir: Path, tensors: dict, step: int = 2) -> Path:
    return save_checkpoint(run_dir, LearnerState(step=step, version=step), tensors, b"")


def test_full_checkpoint_is_the_model_in_the_engine_dtype(tiny, tmp_path):
    sd = _hf_state(tiny)
    ckpt = _save(tmp_path / "run", {"model": sd, "optimizer": {}})
    state, weights, kind = checkpoint_weights(ckpt, str(tiny), 16.0, torch.bfloat16)
    assert (state.step, state.version, kind) == (2, 2, "full weights")
    assert set(weights) == set(model_manifest(tiny))
    for k, t in weights.items():
        assert t.dtype == torch.bfloat16
        torch.testing.assert_close(t, sd[k].to(torch.bfloat16), rtol=0, atol=0)


def test_lora_checkpoint_is_merged_as_peft_merges_it(tiny, tmp_path):
    model = _lora_model(tiny, r=4, alpha=8.0)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert any(k.endswith("lora_A.default.weight") for k in sd)
    ckpt = _save(tmp_path / "run", {"model": sd})
    _state, weights, kind = checkpoint_weights(ckpt, str(tiny), 8.0, torch.float32)
    assert kind == "full weights, LoRA rank 4 alpha 8 (6 modules merged)"  # 2 layers x 3 targets
    merged = model.merge_and_unload().state_dict()
    assert set(weights) == set(model_manifest(tiny))
    for k, t in weights.items():
        torch.testing.assert_close(t, merged[k], rtol=1e-5, atol=1e-6, msg=k)
    # The biases of the LoRA-targeted Qwen2 projections keep their base names.
    assert "model.layers.0.self_attn.q_proj.bias" in weights


def test_lora_scale_uses_the_adapters_own_rank():
    state = {"base_model.model.m.q_proj.base_layer.weight": torch.zeros(6, 5),
             "base_model.model.m.q_proj.lora_A.default.weight": torch.zeros(4, 5),
             "base_model.model.m.q_proj.lora_B.default.weight": torch.zeros(6, 4)}
    assert lora_scales(state, 16.0) == {"base_model.model.m.q_proj": 4.0}
    del state["base_model.model.m.q_proj.lora_B.default.weight"]
    with pytest.raises(CheckpointError, match="lacks its lora_A, lora_B or base_layer"):
        engine_weights(state, 16.0, torch.float32)


def test_kind_is_told_from_the_checkpoint(tmp_path):
    assert checkpoint_kind({"model": {}}, tmp_path) == "full"
    with pytest.raises(CheckpointError, match="ZeRO-3 but has no deepspeed/zero/"):
        checkpoint_kind({"deepspeed_zero_stage": 3, "scheduler": {}}, tmp_path)
    (tmp_path / "deepspeed" / "zero").mkdir(parents=True)
    assert checkpoint_kind({"deepspeed_zero_stage": 2}, tmp_path) == "deepspeed"
    with pytest.raises(CheckpointError, match="holds no model weights"):
        checkpoint_kind({"scheduler": {}}, tmp_path)


@pytest.fixture
def fake_zero_to_fp32(monkeypatch):
    """deepspeed.utils.zero_to_fp32 replaced: records its calls, prints as the real one does,
    returns ``result['sd']`` (or raises ``result['error']``)."""
    result: dict = {"calls": []}

    def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None):
        result["calls"].append((checkpoint_dir, tag))
        print("Processing zero checkpoint ...")
        if "error" in result:
            raise result["error"]
        return result["sd"]

    mod = types.ModuleType("deepspeed.utils.zero_to_fp32")
    mod.get_fp32_state_dict_from_zero_checkpoint = get_fp32_state_dict_from_zero_checkpoint
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    monkeypatch.setitem(sys.modules, "deepspeed.utils", types.ModuleType("deepspeed.utils"))
    monkeypatch.setitem(sys.modules, "deepspeed.utils.zero_to_fp32", mod)
    return result


def _ds_checkpoint(run_dir: Path, stage: int = 3) -> Path:
    def shards(tmp: Path) -> None:
        (tmp / "deepspeed" / "zero").mkdir(parents=True)

    return save_checkpoint(run_dir, LearnerState(step=2, version=2),
                           {"deepspeed_zero_stage": stage, "scheduler": {}}, b"", shards=shards)


def test_deepspeed_lora_checkpoint_is_consolidated_then_merged(tiny, tmp_path, capsys,
                                                               fake_zero_to_fp32):
    model = _lora_model(tiny)
    # The learner's DeepSpeed engine wraps the model (pipeline.learner.logprobs.Policy).
    fake_zero_to_fp32["sd"] = {f"model.{k}": v.detach().clone()
                               for k, v in model.state_dict().items()}
    ckpt = _ds_checkpoint(tmp_path / "run")
    _state, weights, kind = checkpoint_weights(ckpt, str(tiny), 8.0, torch.float32)
    assert fake_zero_to_fp32["calls"] == [(str(ckpt / "deepspeed"), "zero")]
    assert kind == "DeepSpeed ZeRO-3 (consolidated), LoRA rank 4 alpha 8 (6 modules merged)"
    merged = model.merge_and_unload().state_dict()
    for k, t in weights.items():
        torch.testing.assert_close(t, merged[k], rtol=1e-5, atol=1e-6, msg=k)
    assert capsys.readouterr().out == ""  # zero_to_fp32's prints are not the command's output


def test_unreadable_partitions_fail_in_one_line(tiny, tmp_path, fake_zero_to_fp32):
    fake_zero_to_fp32["error"] = FileNotFoundError(
        "can't find model states file at\n'.../zero_pp_rank_1_mp_rank_00_model_states.pt'")
    ckpt = _ds_checkpoint(tmp_path / "run")
    with pytest.raises(CheckpointError) as info:
        checkpoint_weights(ckpt, str(tiny), 16.0, torch.float32)
    msg = str(info.value)
    assert "\n" not in msg and "DeepSpeed partitions unreadable" in msg
    assert "zero_pp_rank_1" in msg


def test_another_models_weights_are_named_by_what_differs():
    t = torch.zeros
    manifest = {"a": (2, 3), "b": (4,), "c": (1,)}
    check_fits_model({"a": t(2, 3), "b": t(4), "c": t(1)}, manifest, Path("ck"), "m")
    with pytest.raises(CheckpointError) as info:
        check_fits_model({"a": t(3, 3), "b": t(4), "x.lora_A.weight": t(1)}, manifest,
                         Path("ck"), "m")
    msg = str(info.value)
    assert "1 tensor(s) not in the model, e.g. ['x.lora_A.weight']" in msg
    assert "1 with another shape, e.g. a (3, 3) (model (2, 3))" in msg
    assert "1 of the model's tensor(s) missing, e.g. ['c']" in msg


# ---------------------------------------------------------------- the command, end to end
@pytest.fixture
def no_engine(monkeypatch):
    """Any engine start fails the test: refusals must come before it."""
    import pipeline.producer.engine as engine

    def refuse(*_a, **_k):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(engine, "build_engine", refuse)


def _run_dir(tmp_path: Path, model: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({
        "model": {"path": str(model)}, "data": {"path": "arithmetic:8"},
        "eval": {"data": "arithmetic:4"}}))
    return run


def _eval(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()  # the fixtures' own output (transformers' progress bars)
    code = evaluation.main(argv)
    return code, capsys.readouterr().err


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("pipeline-train eval: "), err
    assert "Traceback" not in err
    return err


def test_another_models_checkpoint_is_refused_before_any_engine(tiny, tmp_path, capsys,
                                                                no_engine):
    other = build_tiny_model(tmp_path / "other", arch="llama", vocab=300)
    ckpt = _save(_run_dir(tmp_path, tiny), {"model": _hf_state(other)})
    code, err = _eval(["--checkpoint", str(ckpt)], capsys)
    assert code == 2
    line = _one_line(err)
    assert "does not hold the weights of model.path" in line
    assert "2 with another shape, e.g. lm_head.weight (300, 128) (model (260, 128))" in line
    assert "missing, e.g. ['model.layers.0.self_attn.k_proj.bias'" in line  # llama: no bias


@pytest.mark.parametrize("damage", ["tensors", "deepspeed", "torn"])
def test_a_damaged_checkpoint_is_refused_in_one_line(damage, tiny, tmp_path, capsys, no_engine):
    run = _run_dir(tmp_path, tiny)
    if damage == "deepspeed":  # a ZeRO checkpoint whose partitions are gone
        ckpt = _save(run, {"deepspeed_zero_stage": 3, "scheduler": {}})
    else:
        ckpt = _save(run, {"model": _hf_state(tiny)})
        tensors = next(ckpt.glob("tensors-*.safetensors"))
        if damage == "tensors":
            tensors.unlink()
        else:
            data = tensors.read_bytes()
            tensors.write_bytes(data[: len(data) // 2])
    code, err = _eval(["--checkpoint", str(run)], capsys)  # a run dir: its latest
    assert code == 2
    line = _one_line(err)
    assert str(ckpt) in line
    assert {"tensors": "tensors-00000.safetensors", "deepspeed": "deepspeed/zero/",
            "torn": "unreadable"}[damage] in line

