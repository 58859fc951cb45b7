"""An OOM in a training step (pipeline.learner.oom), forced on CPU by the test hook
PIPELINE_TEST_OOM_ABOVE_TOKENS on the tiny model: one warning line, the same batch retried at half
the micro-batch tokens and trained (nothing dropped), and one line below the floor; the bf16-moment
AdamW (pipeline.learner.optim) against torch's."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from buffer.schema import Completion, RolloutGroup
from pipeline.config import load_config
from pipeline.learner.oom import INJECT_ENV, MemoryFloorError, halved, micro_batch_tokens
from pipeline.learner.optim import AdamWBf16Moments
from pipeline.learner.trainer import PolicyTrainer


def _groups(n: int = 2) -> list[RolloutGroup]:
    rng = np.random.default_rng(0)
    out = []
    for k in range(n):
        comps = [Completion(token_ids=rng.integers(32, 127, size=t).astype(np.int32),
                            logprobs=(-rng.random(t) - 0.1).astype(np.float32),
                            version_segments=[(0, 0)], reward=float(i % 2))
                 for i, t in enumerate([12, 16, 9, 14])]
        out.append(RolloutGroup(group_id=f"g{k}", producer_id="p0", prompt_id=f"g{k}",
                                prompt_token_ids=rng.integers(32, 127, size=8).astype(np.int32),
                                completions=comps))
    return out


@pytest.fixture(scope="module")
def shared(tiny_model, tmp_path_factory):
    cfg = load_config(overrides={
        "model.path": str(tiny_model), "data.path": "arithmetic:10",
        "run_dir": str(tmp_path_factory.mktemp("run")), "train.lr": 1e-3,
        "train.micro_batch": 8, "generation.group_size": 4})
    return PolicyTrainer(cfg, str(tiny_model), device="cpu")


@pytest.fixture
def trainer(shared):
    shared.cfg.train.micro_batch_tokens = 0  # a retry halves it for later steps: start afresh
    return shared


def test_pure_budget_arithmetic():
    assert micro_batch_tokens([10, 20, 5], 2, 0, False) == 40  # rows: 2 x longest 20
    assert micro_batch_tokens([10, 20, 5], 8, 30, True) == 30  # packed: 20 + 10, then 5
    assert halved(40, 20) == 20 and halved(30, 20) == 20 and halved(20, 20) is None


def test_injected_oom_retries_the_same_batch_in_one_line(trainer, monkeypatch, caplog):
    groups = _groups()
    longest = max(len(g.prompt_token_ids) + len(c.token_ids) for g in groups
                  for c in g.completions)
    monkeypatch.setenv(INJECT_ENV, str(3 * longest))  # a card that fits 3 sequences
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with caplog.at_level(logging.WARNING):
        m = trainer.step(groups, 0)
    lines = [r.getMessage() for r in caplog.records if "out of GPU memory" in r.getMessage()]
    assert m["oom_retries"] >= 1 and len(lines) == 1
    assert "--train.micro_batch_tokens" in lines[0]
    assert trainer.cfg.train.micro_batch_tokens == m["micro_batch_tokens"] <= 3 * longest
    assert m["skipped_nonfinite"] == 0.0
    assert m["trained_tokens"] == sum(len(c.token_ids) for g in groups for c in g.completions)
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # The next step starts at the smaller budget: no OOM, no line.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert trainer.step(groups, 1)["oom_retries"] == 0
    assert not [r for r in caplog.records if "out of GPU memory" in r.getMessage()]


def test_below_the_floor_the_step_stops_in_one_line(trainer, monkeypatch):
    monkeypatch.setenv(INJECT_ENV, "1")  # not even one sequence fits
    with pytest.raises(MemoryFloorError) as e:
        trainer.step(_groups(), 0)
    assert "\n" not in str(e.value) and "one sequence" in str(e.value)


def test_bf16_moments_follow_torch_adamw():
    torch.manual_seed(0)
    w0 = torch.randn(3000, 7)
    a, b = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = torch.optim.AdamW([a], lr=1e-2, weight_decay=0.1)
    ours = AdamWBf16Moments([b], lr=1e-2, weight_decay=0.1)
    for _ in range(5):
        g = torch.randn_like(w0)
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    assert ours.state[b]["exp_avg"].dtype == torch.bfloat16 and b.dtype == torch.float32
    assert torch.allclose(a, b, atol=2e-3)
    assert (a - w0).abs().mean() > 1e-2  # it moved
