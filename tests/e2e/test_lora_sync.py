"""LoRA adapter-only sync on real vLLM CPU engines (tiny model), checked by effect.

1. A LoRA run through the real launcher trains several steps with adapter sync: every snapshot
   holds the adapter alone, and the producer served each version as a LoRARequest (its acks).
   (A rank vLLM cannot serve falls back to merged weights with one warning:
   test_eval_checkpoints.py.)
2. The producer's AdapterSet on a real engine: prompt logprobs of a fixed prompt change with the
   version, and follow the trainer's own (peft) logprobs of that version, not the base's.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors import safe_open

from tests.e2e.support.launcher import read_metrics
from tests.e2e.support.train_run import pipeline_train, tiny_args

pytestmark = pytest.mark.slow

PROBE = [ord(c) for c in "The quick brown fox jumps over the lazy dog."]


def _lora_run(tiny_model: Path, tmp_path: Path, *extra: str) -> tuple[Path, Path, str, str]:
    """A LoRA run through the real launcher; returns (run dir, snapshot dir, all its logs, the
    console alone)."""
    run_dir, snaps = tmp_path / "run", tmp_path / "snaps"
    proc = pipeline_train(
        *tiny_args(tiny_model, run_dir),
        "--reward", "pipeline.tasks.rewards:length_reward", "--mode", "async",
        "--max-staleness", "1", "--steps", "4", "--train.lr", "0.01",
        "--sync.snapshot_dir", str(snaps), "--sync.keep_snapshots", "4", "--tensorboard", "false",
        "--sync.lora_adapters", "on",  # adapters on CPU too ('auto' merges there)
        *extra,
        tag="lora",
    )
    console = proc.stdout + proc.stderr
    logs = console + "".join(
        f.read_text(errors="replace") for f in sorted((run_dir / "logs").glob("*.log")))
    return run_dir, snaps, logs, console


def _snapshot_names(snaps: Path) -> list[str] | None:
    files = sorted(snaps.glob("policy_v*.safetensors"))
    if not files:  # the learner may clean its snapshot dir at exit
        return None
    with safe_open(str(files[-1]), framework="pt") as st:
        return list(st.keys())


def test_lora_run_trains_with_adapter_only_sync(tiny_model, tmp_path):
    run_dir, snaps, logs, console = _lora_run(tiny_model, tmp_path, "--train.lora_rank", "8")
    assert "merged full weights" not in logs
    rows = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert max(r.get("version", 0) for r in rows) >= 3
    # The producer acked versions it swapped to as adapters, and no swap failed.
    assert any(r.get("producers_acked", 0) >= 1 for r in rows), rows
    assert "serves each version as a LoRA adapter" in logs
    assert "swap to v" not in logs, logs[-4000:]
    names = _snapshot_names(snaps)
    if names is not None:
        assert names and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in names)
    _assert_console_ends_with_the_summary(console)
    _assert_engine_shut_down_in_order(run_dir)


def _assert_engine_shut_down_in_order(run_dir: Path) -> None:
    """The producer began its engine's shutdown before the engine core got a signal (from the
    producer's engine client, not from the launcher): vLLM's workers stop under a core that
    is shutting down, never die under a live one."""
    from pipeline.procs import ENGINE_SHUTDOWN

    lines = (run_dir / "logs" / "producer-0.log").read_text(errors="replace").splitlines()
    ours = [i for i, x in enumerate(lines) if ENGINE_SHUTDOWN in x]
    core = [i for i, x in enumerate(lines) if re.search(r"EngineCore.*received signal", x)]
    assert ours and core and ours[0] < core[0], "\n".join(lines[-40:])
    assert not [x for x in lines if "died unexpectedly" in x or "fatal error" in x]


def _assert_console_ends_with_the_summary(console: str) -> None:
    """No engine error, scheduler dump or traceback of the engine's shutdown on the console."""
    lines = console.splitlines()
    errors = [x for x in lines
              if re.search(r"\bERROR\b|Traceback|died unexpectedly|EngineCore|Scheduler", x)]
    assert not errors, console[-6000:]
    out = [x for x in lines if x.startswith(("reward: first", "logs: "))]
    assert len(out) == 2, console[-6000:]


def _prompt_logprobs(out) -> np.ndarray:
    lps = out.prompt_logprobs[1:]
    return np.array([d[t].logprob for d, t in zip(lps, PROBE[1:], strict=True)])


def test_adapter_versions_change_engine_logprobs(tiny_model, tmp_path):
    from vllm import SamplingParams

    from pipeline.config import EngineConfig, ModelConfig, load_config
    from pipeline.learner.logprobs import token_logprobs
    from pipeline.learner.trainer import PolicyTrainer
    from pipeline.producer.adapters import AdapterSet
    from pipeline.producer.engine import build_engine
    from sync.lora import adapter_config
    from sync.snapshot import write_snapshot

    cfg = load_config(
        overrides={
            "model.path": str(tiny_model),
            "data.path": "arithmetic:10",
            "run_dir": str(tmp_path),
            "rewards.specs": [{"fn": "pipeline.tasks.rewards:length_reward", "weight": 1.0}],
            "model.dtype": "float32",
            "train.lora_rank": 8,
            "train.lora_alpha": 16.0,
            "sync.lora_adapters": "on",
        }
    )
    tr = PolicyTrainer(cfg, str(tiny_model), device="cpu")
    assert tr.adapter_sync
    ids = torch.tensor([PROBE])
    mask = torch.ones(1, len(PROBE) - 1, dtype=torch.bool)

    def trainer_lps() -> np.ndarray:
        with torch.no_grad():
            return token_logprobs(tr.model, ids, torch.ones_like(ids), mask)[0].numpy()

    snaps, want = {}, {0: trainer_lps()}
    g = torch.Generator().manual_seed(0)
    for v in (1, 2):  # two versions: distinct adapters (as training steps would give)
        with torch.no_grad():
            for n, p in tr.model.named_parameters():
                if "lora_" in n:
                    p.add_(torch.randn(p.shape, generator=g) * 0.3)
        snaps[v] = write_snapshot(tr.snapshot_tensors(), v, tmp_path / "snaps")
        want[v] = trainer_lps()

    async def main() -> dict[int, np.ndarray]:
        engine = build_engine(
            ModelConfig(dtype="float32"),
            EngineConfig(max_model_len=256, cpu_kvcache_space_gib=1),
            str(tiny_model),
            seed=0,
            lora_rank=8,
            max_loras=2,
        )
        try:
            ad = AdapterSet(
                engine, "lora-test", adapter_config(8, 16.0, list(cfg.train.lora_target_modules))
            )
            sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
            got = {}
            for v in (0, 1, 2):
                if v:
                    await ad.stage(snaps[v])
                    await ad.switch(v)
                lora = ad.request_for(v)
                final = None
                async for out in engine.generate(
                    {"prompt_token_ids": PROBE}, sp, f"r{v}", lora_request=lora
                ):
                    final = out
                await ad.release(v)
                got[v] = _prompt_logprobs(final)
            # Only the current adapter is left loaded; the older one was removed.
            assert sorted(ad.requests) == [2]
            assert sorted(await engine.list_loras()) == [2]
            return got
        finally:
            engine.shutdown()

    got = asyncio.run(main())
    for v in (1, 2):
        assert np.abs(got[v] - got[0]).max() > 0.05, f"v{v}: adapter had no effect"
        # The engine follows this version's trainer logprobs far closer than the base's.
        err = np.abs(got[v] - want[v]).mean()
        assert err < 0.2 * np.abs(want[v] - want[0]).mean(), (v, err)
    assert np.abs(got[2] - got[1]).max() > 0.05


def test_readme_lora_line_on_the_demo_config_trains_and_ends_quietly(tiny_model, tmp_path):
    # README: `pipeline-train --config examples/demo.yaml` with `--train.lora_rank 16`; the demo
    # sets train.freeze_layers (20: more layers than the tiny model has), which LoRA supersedes.
    # The demo's model and sizes are swapped for the tiny model's (tiny_args) and a few steps.
    run_dir = tmp_path / "demo-lora"
    proc = pipeline_train(
        "--config", "examples/demo.yaml", "--train.lora_rank", "16",
        *tiny_args(tiny_model, run_dir), "--steps", "3", "--tensorboard", "false",
        tag="demolora",
    )
    # The launcher decides it once and says so on the console (pipeline.launch.derive).
    console = proc.stdout + proc.stderr
    warned = [x for x in console.splitlines() if "freeze_layers" in x]
    assert len(warned) == 1 and "ignored" in warned[0], console[-3000:]
    # On CPU, sync.lora_adapters auto ships merged versions (vLLM's CPU LoRA kernels are slow).
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["sync"]["lora_adapters"] == "off"
    logs = (run_dir / "logs" / "producer-0.log").read_text(errors="replace")
    assert "serves each version as a LoRA adapter" not in logs
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    _assert_console_ends_with_the_summary(proc.stdout + proc.stderr)
    _assert_engine_shut_down_in_order(run_dir)


def test_adapter_merged_on_the_producer_matches_weights_merged_on_the_learner(tiny_model,
                                                                            tmp_path):
    """``sync.lora_adapters: merge`` on a real engine (bf16, no LoRA support enabled): a version
    shipped as the adapter alone and merged by the engine's workers gives the prompt logprobs of
    the same version shipped as weights the learner merged, within bf16 rounding; both differ
    from the base weights'. The adapter file is a small fraction of the merged one."""
    from vllm import SamplingParams

    from pipeline.config import EngineConfig, ModelConfig, load_config
    from pipeline.learner.trainer import PolicyTrainer
    from pipeline.producer.engine import build_engine
    from sync.snapshot import write_snapshot

    cfg = load_config(overrides={
        "model.path": str(tiny_model), "data.path": "arithmetic:10", "run_dir": str(tmp_path),
        "rewards.specs": [{"fn": "pipeline.tasks.rewards:length_reward", "weight": 1.0}],
        "model.dtype": "bfloat16", "train.lora_rank": 8, "train.lora_alpha": 16.0,
        "sync.lora_adapters": "merge"})
    tr = PolicyTrainer(cfg, str(tiny_model), device="cpu")
    assert tr.adapter_sync  # merge ships the adapter alone, as 'on' does
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in tr.model.named_parameters():
            if "lora_" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    adapter = write_snapshot(tr.snapshot_tensors(), 2, tmp_path / "adapter")
    tr.adapter_sync = False  # the same version as the learner merges it (lora_adapters off)
    merged = write_snapshot(tr.snapshot_tensors(), 1, tmp_path / "merged")
    del tr
    assert Path(adapter.uri).stat().st_size < 0.5 * Path(merged.uri).stat().st_size

    async def main() -> dict[str, np.ndarray]:
        engine = build_engine(ModelConfig(dtype="bfloat16"),
                              EngineConfig(max_model_len=256, cpu_kvcache_space_gib=1),
                              str(tiny_model), seed=0)
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

        async def probe(tag: str) -> np.ndarray:
            final = None
            async for out in engine.generate({"prompt_token_ids": PROBE}, sp, tag):
                final = out
            return _prompt_logprobs(final)

        try:
            got = {"base": await probe("base")}
            await engine.collective_rpc("sync_load_snapshot",
                                        args=(merged.version, merged.uri, merged.checksum))
            got["learner"] = await probe("learner")
            await engine.collective_rpc("sync_lora_merge", args=(16.0 / 8,))
            await engine.collective_rpc("sync_load_snapshot",
                                        args=(adapter.version, adapter.uri, adapter.checksum))
            got["producer"] = await probe("producer")
            return got
        finally:
            engine.shutdown()

    got = asyncio.run(main())
    effect = np.abs(got["learner"] - got["base"])
    assert effect.max() > 0.05, "the adapter had no effect"
    # The two merges round differently (the learner merges its fp32 A and B and casts the sum to
    # bf16; the producer merges the bf16 A and B of the file), so the logprobs differ by bf16
    # rounding, far below the adapter's own effect.
    diff = np.abs(got["producer"] - got["learner"])
    assert diff.max() < 0.15 * effect.max() and diff.mean() < 0.1 * effect.mean(), \
        (diff.max(), diff.mean(), effect.max(), effect.mean())


def test_lora_run_merges_adapters_on_the_producer(tiny_model, tmp_path):
    """The launcher with ``sync.lora_adapters merge``: every version's file holds the adapter
    alone, the producer merged each one into its weights (no LoRARequest, no failed swap)."""
    run_dir, snaps, logs, console = _lora_run(tiny_model, tmp_path, "--train.lora_rank", "8",
                                              "--sync.lora_adapters", "merge")
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert any(r.get("producers_acked", 0) >= 1 for r in rows), rows
    assert "merges each version's LoRA adapter (rank 8) into its weights" in logs
    assert "serves each version as a LoRA adapter" not in logs
    assert "swap to v" not in logs, logs[-4000:]
    names = _snapshot_names(snaps)
    if names is not None:
        assert names and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in names)
    _assert_console_ends_with_the_summary(console)
