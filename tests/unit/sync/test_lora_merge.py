"""``sync.lora_adapters: merge``: the adapter a learner ships, merged into the base weights where
they are served (``sync.lora.merge_adapter``, ``BaseWeights``), equals the learner's own merge
(``pipeline.learner.lora.merge_lora``); a broken adapter is refused before anything is returned.
Real safetensors files; no engine (tests/e2e/test_lora_sync.py loads it into one)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from pipeline.learner.lora import merge_lora
from sync.lora import BaseWeights, base_name, merge_adapter
from sync.snapshot import SnapshotError

MODULES = ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj")
SHAPES = {"model.layers.0.self_attn.q_proj": (16, 8), "model.layers.0.mlp.down_proj": (8, 24)}


def _peft_state(rank: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for m in MODULES:
        out_f, in_f = SHAPES[m]
        p = f"base_model.model.{m}"
        state[f"{p}.base_layer.weight"] = torch.randn(out_f, in_f, generator=g)
        state[f"{p}.lora_A.default.weight"] = torch.randn(rank, in_f, generator=g)
        state[f"{p}.lora_B.default.weight"] = torch.randn(out_f, rank, generator=g)
    return state


def _adapter(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's saved names (``sync.lora.adapter_tensors``)."""
    return {k.replace(".default.weight", ".weight"): v for k, v in state.items()
            if ".lora_" in k}


def _base(state: dict[str, torch.Tensor], tmp_path, dtype=torch.float32) -> BaseWeights:
    """The model's files: the base weights under their HF names, in two shards."""
    tensors = {f"{m}.weight": state[f"base_model.model.{m}.base_layer.weight"].to(dtype)
               for m in MODULES}
    tensors["model.embed_tokens.weight"] = torch.zeros(4, 8, dtype=dtype)
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[:1]}, str(tmp_path / "model-1.safetensors"))
    save_file({k: tensors[k] for k in names[1:]}, str(tmp_path / "model-2.safetensors"))
    return BaseWeights(tmp_path)


def test_base_name_maps_peft_names_to_the_model_files():
    assert base_name("base_model.model.model.layers.3.mlp.up_proj.lora_A.weight") == \
        "model.layers.3.mlp.up_proj.weight"
    assert base_name("base_model.model.model.layers.3.mlp.up_proj.lora_B.weight") == \
        "model.layers.3.mlp.up_proj.weight"


def test_merge_on_the_producer_equals_the_learners_merge(tmp_path):
    state = _peft_state()
    scale = 2.0
    want = merge_lora(state, {f"base_model.model.{m}": scale for m in MODULES})
    got = merge_adapter(_adapter(state), _base(state, tmp_path), scale)
    assert sorted(got) == sorted(want) == sorted(f"{m}.weight" for m in MODULES)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5)


def test_merge_keeps_the_base_dtype_and_reads_each_base_weight_once(tmp_path):
    state = _peft_state()
    base = _base(state, tmp_path, dtype=torch.bfloat16)
    got = merge_adapter({k: v.to(torch.bfloat16) for k, v in _adapter(state).items()}, base,
                        2.0)
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    first = base("model.layers.0.mlp.down_proj.weight")
    assert base("model.layers.0.mlp.down_proj.weight") is first  # held, not read again
    # A zero B (peft's initial adapter) gives the base weights back exactly.
    zero = {k: (torch.zeros_like(v) if ".lora_B." in k else v)
            for k, v in _adapter(state).items()}
    for k, v in merge_adapter(zero, base, 2.0).items():
        assert torch.equal(v, base(k))


def test_a_broken_adapter_is_refused(tmp_path):
    state = _peft_state()
    base = _base(state, tmp_path)
    adapter = _adapter(state)
    no_b = {k: v for k, v in adapter.items() if "q_proj.lora_B" not in k}
    with pytest.raises(SnapshotError, match="lacks its B tensor"):
        merge_adapter(no_b, base, 2.0)
    wrong = dict(adapter)
    wrong["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"] = torch.ones(4, 9)
    with pytest.raises(SnapshotError, match=r"B @ A is \(8, 9\)"):
        merge_adapter(wrong, base, 2.0)
    with pytest.raises(SnapshotError, match="not a LoRA adapter"):
        merge_adapter({"model.layers.0.mlp.down_proj.weight": torch.ones(8, 24)}, base, 2.0)
    other = {k.replace("layers.0", "layers.7"): v for k, v in adapter.items()}
    with pytest.raises(SnapshotError, match="not in the model's files"):
        merge_adapter(other, base, 2.0)
