"""bench.gpu_model: the tensor list matches transformers' Qwen2 (real load of a small shape)."""

from __future__ import annotations

import json

import pytest

from bench.gpu_model import SIZES, num_params, plan_shards, tensor_specs, write_model

SMALL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             intermediate_size=256, vocab_size=512, max_position_embeddings=256)


@pytest.mark.parametrize("size,billions", [("0.5b", 0.494), ("1.5b", 1.544), ("3b", 3.086),
                                          ("7b", 7.616)])
def test_parameter_counts_are_qwens(size, billions):
    assert num_params(SIZES[size]) / 1e9 == pytest.approx(billions, abs=1e-3)


def test_shards_stay_under_the_limit_and_keep_every_tensor_once():
    specs = tensor_specs(SIZES["7b"])
    shards = plan_shards(specs, shard_bytes=4 << 30)
    assert [n for s in shards for n in s] == [n for n, _, _ in specs]
    sizes = {n: 2 * __import__("math").prod(shape) for n, shape, _ in specs}
    assert all(sum(sizes[n] for n in s) <= 4 << 30 for s in shards)


@pytest.mark.parametrize("tied", [True, False])
def test_written_model_loads_in_transformers_with_no_missing_or_extra_weight(tmp_path, tied):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    spec = dict(SMALL, tie_word_embeddings=tied)
    # a tiny shard limit: several shards and an index, as 3b/7b get
    n = write_model(tmp_path, spec, device="cpu", shard_bytes=200_000)
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert sum(p.numel() for p in model.parameters()) == n
    assert model.config.tie_word_embeddings is tied
    w = model.model.layers[0].mlp.up_proj.weight.float()
    assert abs(w.std().item() - 0.02) < 0.002 and model.model.norm.weight.eq(1).all()
    assert model.model.layers[0].self_attn.q_proj.bias.eq(0).all()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    out = model(torch.tensor([[1, 5, 7]]))
    assert out.logits.shape == (1, 3, 512)


def test_main_writes_a_model_vllm_and_the_bench_can_read(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    import bench.gpu_model as gm

    monkeypatch.setitem(gm.SIZES, "0.5b", dict(SMALL, tie_word_embeddings=True))
    assert gm.main([str(tmp_path / "m"), "--size", "0.5b", "--device", "cpu"]) == 0
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["vocab_size"] == 512
    assert (tmp_path / "m" / "model.safetensors").exists()  # one shard: no index
    assert AutoTokenizer.from_pretrained(tmp_path / "m").chat_template
