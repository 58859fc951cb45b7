"""LoRA through peft on the tiny model: merged snapshots (vs peft's merge_and_unload), only LoRA
parameters train, snapshot names/shapes match the base model's files, checkpoint round trip."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from buffer.schema import Completion, RolloutGroup
from pipeline.config import load_config
from pipeline.learner.trainer import PolicyTrainer
from pipeline.options import ConfigError
from sync.snapshot import check_against_manifest, model_manifest

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _cfg(tiny_model, tmp_path, **over):
    base = {"model.path": str(tiny_model), "data.path": "arithmetic:10",
            "rewards.specs": [{"fn": "pipeline.tasks.rewards:length_reward", "weight": 1.0}],
            "run_dir": str(tmp_path), "train.lora_lr": 1e-2, "train.micro_batch": 3,
            "generation.group_size": 4, "model.dtype": "float32",
            "train.lora_rank": 4, "train.lora_alpha": 8.0,
            "train.lora_target_modules": TARGETS, "sync.lora_adapters": "off"}
    base.update(over)
    return load_config(overrides=base)


def _groups(seed: int = 0) -> list[RolloutGroup]:
    rng = np.random.default_rng(seed)

    def group(gid, plen, lens, rewards):
        comps = [Completion(token_ids=rng.integers(32, 127, size=t).astype(np.int32),
                            logprobs=(-rng.random(t) - 0.1).astype(np.float32),
                            version_segments=[(0, 0)], reward=r) for t, r in zip(lens, rewards,
                                                                                 strict=True)]
        return RolloutGroup(group_id=gid, producer_id="p0", prompt_id=gid,
                            prompt_token_ids=rng.integers(32, 127, size=plen).astype(np.int32),
                            completions=comps)

    return [group("a", 5, [3, 6, 1, 4], [0.0, 1.0, 0.5, 0.2]),
            group("b", 8, [2, 5, 7, 3], [1.0, 0.0, 0.0, 1.0])]


@pytest.fixture
def trainer(tiny_model, tmp_path):
    return PolicyTrainer(_cfg(tiny_model, tmp_path), str(tiny_model), device="cpu")


def _perturb_lora(tr: PolicyTrainer) -> None:
    """lora_B starts at zero (merge = base); give it values so the merge is not trivial."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in tr.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_merged_snapshot_equals_peft_merge_and_unload(trainer):
    _perturb_lora(trainer)
    snap = trainer.snapshot_tensors()
    merged = copy.deepcopy(trainer.model).merge_and_unload().state_dict()
    assert snap, "no tensors in the snapshot"
    for name, t in snap.items():
        assert name in merged, name
        torch.testing.assert_close(t, merged[name].to(t.dtype), rtol=1e-5, atol=1e-6)
    # Exactly the targeted linear weights travel (biases and everything else never change).
    want = {k for k in merged if k.endswith(".weight") and k.split(".")[-2] in TARGETS}
    assert set(snap) == want


def test_one_step_changes_only_lora_params(trainer):
    assert trainer.scheduler.get_last_lr() == [1e-2]  # train.lora_lr, not train.lr
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    m = trainer.step(_groups(), learner_version=0)
    assert m["skipped_nonfinite"] == 0.0 and m["grad_norm"] > 0
    after = trainer.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed, "the step changed nothing"
    assert all("lora_" in k for k in changed), sorted(changed)[:5]
    # lora_B starts at zero, so the first step moves B only (A's gradient is B^T-weighted).
    assert any("lora_B" in k for k in changed)


def test_snapshot_names_and_shapes_match_the_base_model_files(trainer, tiny_model):
    trainer.step(_groups(), learner_version=0)
    snap = trainer.snapshot_tensors()
    manifest = model_manifest(tiny_model)
    assert set(snap) <= set(manifest)
    check_against_manifest(snap, manifest, version=1)  # raises on a wrong shape
    assert all(t.dtype == torch.float32 for t in snap.values())


def test_snapshot_dtype_follows_model_dtype(tiny_model, tmp_path):
    tr = PolicyTrainer(_cfg(tiny_model, tmp_path, **{"model.dtype": "bfloat16"}),
                       str(tiny_model), device="cpu")
    assert all(t.dtype == torch.bfloat16 for t in tr.snapshot_tensors().values())


def test_checkpoint_state_round_trip_with_peft(trainer, tiny_model, tmp_path):
    trainer.step(_groups(), learner_version=0)
    state = copy.deepcopy(trainer.state())
    assert any("lora_A" in k for k in state["model"])
    snap = trainer.snapshot_tensors()
    fresh = PolicyTrainer(_cfg(tiny_model, tmp_path), str(tiny_model), device="cpu")
    fresh.load_state(state)
    for k, v in fresh.snapshot_tensors().items():
        assert torch.equal(v, snap[k]), k
    # Both continue identically from the restored optimiser state.
    m1, m2 = trainer.step(_groups(1), 1), fresh.step(_groups(1), 1)
    assert m1["loss/loss"] == pytest.approx(m2["loss/loss"], rel=1e-5)


@pytest.mark.parametrize("over", [{"train.lora_rank": -1}, {"train.lora_alpha": 0},
                                  {"train.lora_dropout": 1.0},
                                  {"train.lora_target_modules": []}])
def test_bad_lora_options_name_the_option(tiny_model, tmp_path, over):
    with pytest.raises(ConfigError, match=r"train\.lora"):
        _cfg(tiny_model, tmp_path, **over)


def test_readme_lora_flag_on_the_demo_config_supersedes_freeze_layers(capsys):
    # README: `pipeline-train --config examples/demo.yaml` and `--train.lora_rank 16`; the demo
    # sets train.freeze_layers, which LoRA makes moot: one console line, then it is 0
    # everywhere.
    from pipeline.config import flatten
    from pipeline.launch.cli import parse
    from pipeline.launch.derive import resolve
    from pipeline.options import to_dict

    cfg, _ = parse(["--config", "examples/demo.yaml", "--train.lora_rank", "16"])
    assert cfg.train.lora_rank == 16 and cfg.train.freeze_layers == 0
    # LoRA's own learning rate, not the demo's full fine-tune one (5e-5): at that, its reward
    # did not rise in 12 steps (BENCHMARKS.md, LoRA on the demo).
    assert cfg.train.lr == 5e-5 and cfg.train.optimizer_lr == cfg.train.lora_lr == 5e-4
    said = [ln for ln in capsys.readouterr().out.splitlines() if "freeze_layers" in ln]
    assert said == ["pipeline-train: train.freeze_layers 20 is ignored: train.lora_rank 16 "
                    "trains LoRA adapters on a frozen base"], said
    # What a child process builds from config.yaml: the same values, and nothing said.
    child = load_config(overrides=flatten(to_dict(cfg)))
    assert child.train.freeze_layers == 0 and to_dict(resolve(child)) == to_dict(cfg)
    assert not capsys.readouterr().out


def test_follower_rank_snapshot_is_empty_not_a_merge_of_nothing(trainer, monkeypatch):
    # Under a multi-rank learner (DDP, or ZeRO-3 after its gather) only rank 0 holds the full
    # state dict; a follower's is empty and must not be merged (it raised KeyError before).
    assert trainer._lora
    monkeypatch.setattr(trainer, "_model_state", lambda: {})
    assert trainer._snapshot() == {}


def test_merge_casts_each_module_to_the_snapshot_dtype(trainer):
    import torch

    from pipeline.learner.lora import merge_lora

    sd = trainer._model_state()
    merged = merge_lora(sd, trainer._lora, torch.bfloat16)
    assert merged and all(t.dtype == torch.bfloat16 for t in merged.values())
    full = merge_lora(sd, trainer._lora)
    for k, t in merged.items():
        torch.testing.assert_close(t, full[k].to(torch.bfloat16))


def test_adapter_sync_snapshot_is_the_peft_adapter(tiny_model, tmp_path):
    tr = PolicyTrainer(_cfg(tiny_model, tmp_path, **{"sync.lora_adapters": "on"}),
                       str(tiny_model), device="cpu")
    assert tr.adapter_sync
    _perturb_lora(tr)
    snap = tr.snapshot_tensors()
    from peft import get_peft_model_state_dict

    want = get_peft_model_state_dict(tr.model)  # what peft's save_pretrained writes
    assert set(snap) == set(want)
    for k, v in snap.items():
        torch.testing.assert_close(v, want[k].to(v.dtype))
    full = sum(t.numel() for t in tr.model.state_dict().values())
    assert sum(t.numel() for t in snap.values()) < full / 10


def test_unservable_targets_fall_back_to_merged(tiny_model, tmp_path):
    # The launcher decides it, in one console line (tests/unit/pipeline/launch/test_derive.py);
    # the trainer ships what the resolved plan says.
    from pipeline.launch.derive import resolve

    cfg = resolve(_cfg(tiny_model, tmp_path, **{"sync.lora_adapters": "on",
                                                "train.lora_target_modules": ["q_proj",
                                                                              "lm_head"]}))
    tr = PolicyTrainer(cfg, str(tiny_model), device="cpu")
    assert not tr.adapter_sync
    snap = tr.snapshot_tensors()
    assert snap and not any("lora" in k for k in snap)


def test_lora_adapters_option_is_validated(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match=r"sync\.lora_adapters"):
        _cfg(tiny_model, tmp_path, **{"sync.lora_adapters": "maybe"})
