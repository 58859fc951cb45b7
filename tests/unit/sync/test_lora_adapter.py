"""sync.lora: the adapter-sync decision, vLLM's rank rounding, and peft's adapter layout on disk
(written from a real snapshot file, read back with safetensors and peft's own config loader)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from sync.lora import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    adapter_config,
    adapter_sync_plan,
    adapter_tensors,
    stage_adapter,
    vllm_max_lora_rank,
)
from sync.snapshot import SnapshotError, write_snapshot

PREFIX = "base_model.model.model.layers.0.self_attn.q_proj"


def test_plan_on_for_supported_modules_off_when_asked_or_full_finetune():
    assert adapter_sync_plan("auto", 8, ["q_proj", "v_proj"]) == (True, "")
    assert adapter_sync_plan("off", 8, ["q_proj"]) == (False, "")
    assert adapter_sync_plan("auto", 0, ["q_proj"]) == (False, "")


def test_plan_falls_back_naming_the_reason():
    on, why = adapter_sync_plan("auto", 8, ["q_proj", "lm_head"])
    assert not on and "lm_head" in why and "train.lora_target_modules" in why
    on, why = adapter_sync_plan("auto", 1024, ["q_proj"])
    assert not on and "1024" in why and "train.lora_rank" in why


def test_max_lora_rank_rounds_up_to_a_value_vllm_accepts():
    assert [vllm_max_lora_rank(r) for r in (1, 4, 8, 9, 64, 300)] == [1, 8, 8, 16, 64, 320]
    with pytest.raises(ValueError):
        vllm_max_lora_rank(513)


def test_adapter_tensors_take_peft_saved_names_and_dtype():
    state = {
        f"{PREFIX}.base_layer.weight": torch.zeros(4, 4),
        f"{PREFIX}.lora_A.default.weight": torch.ones(2, 4),
        f"{PREFIX}.lora_B.default.weight": torch.full((4, 2), 2.0),
    }
    out = adapter_tensors(state, [PREFIX], torch.bfloat16)
    assert set(out) == {f"{PREFIX}.lora_A.weight", f"{PREFIX}.lora_B.weight"}
    assert all(t.dtype == torch.bfloat16 for t in out.values())
    assert out[f"{PREFIX}.lora_B.weight"].shape == (4, 2)


def test_stage_writes_peft_layout_from_a_verified_snapshot(tmp_path):
    tensors = {
        f"{PREFIX}.lora_A.weight": torch.randn(2, 8),
        f"{PREFIX}.lora_B.weight": torch.randn(8, 2),
    }
    ref = write_snapshot(tensors, 3, tmp_path / "snaps")
    cfg = adapter_config(2, 4.0, ["v_proj", "q_proj"], base_model="tiny")
    d = stage_adapter(ref, cfg, tmp_path / "snaps" / "lora-p0" / "v3")
    assert sorted(p.name for p in d.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
    back = load_file(str(d / WEIGHTS_NAME))
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        torch.testing.assert_close(back[k], v)
    written = json.loads((d / CONFIG_NAME).read_text())
    assert written["r"] == 2 and written["lora_alpha"] == 4.0 and written["peft_type"] == "LORA"
    assert written["target_modules"] == ["q_proj", "v_proj"]
    from peft import LoraConfig

    loaded = LoraConfig.from_pretrained(str(d))  # peft reads it as its own
    assert loaded.r == 2 and set(loaded.target_modules) == {"q_proj", "v_proj"}
    assert not list(d.parent.glob(".*tmp"))


def test_stage_refuses_merged_weights_and_bad_checksums(tmp_path):
    merged = write_snapshot(
        {"model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)}, 1, tmp_path
    )
    with pytest.raises(SnapshotError, match="not a LoRA adapter"):
        stage_adapter(merged, adapter_config(2, 4.0, ["q_proj"]), tmp_path / "a")
    good = write_snapshot({f"{PREFIX}.lora_A.weight": torch.zeros(2, 2)}, 2, tmp_path)
    bad = type(good)(good.version, good.uri, "blake3:" + "0" * 32)
    with pytest.raises(SnapshotError, match="checksum"):
        stage_adapter(bad, adapter_config(2, 4.0, ["q_proj"]), tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
