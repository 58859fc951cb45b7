"""PolicyTrainer on the tiny model (transformers only): packing and masks, token logprobs,
the non-finite guard, a normal step, and snapshots with frozen layers."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

from buffer.schema import Completion, RolloutGroup
from pipeline.config import load_config
from pipeline.learner.batching import collate, collate_packed, pack_groups, plan_micro_batches
from pipeline.learner.logprobs import token_logprobs
from pipeline.learner.trainer import PolicyTrainer


def _cfg(tiny_model, tmp_path, **over):
    base = {"model.path": str(tiny_model), "data.path": "arithmetic:10",
            "rewards.specs": [{"fn": "pipeline.tasks.rewards:length_reward", "weight": 1.0}],
            "run_dir": str(tmp_path), "train.lr": 1e-3, "train.micro_batch": 3,
            "generation.group_size": 4}
    base.update(over)
    return load_config(overrides=base)


def _group(rng: np.random.Generator, gid: str, plen: int, lens: list[int],
           rewards: list[float], version: int = 0) -> RolloutGroup:
    comps = [Completion(token_ids=rng.integers(32, 127, size=t).astype(np.int32),
                        logprobs=(-rng.random(t) - 0.1).astype(np.float32),
                        version_segments=[(0, version)], reward=r,
                        reward_breakdown={"length": r})
             for t, r in zip(lens, rewards, strict=True)]
    return RolloutGroup(group_id=gid, producer_id="p0", prompt_id=gid,
                        prompt_token_ids=rng.integers(32, 127, size=plen).astype(np.int32),
                        completions=comps)


def _groups(seed: int = 0) -> list[RolloutGroup]:
    rng = np.random.default_rng(seed)
    return [_group(rng, "a", 5, [3, 6, 1, 4], [0.0, 1.0, 0.5, 0.2]),
            _group(rng, "b", 8, [2, 5, 7, 3], [1.0, 0.0, 0.0, 1.0])]


@pytest.fixture(scope="module")
def trainer(tiny_model, tmp_path_factory):
    return PolicyTrainer(_cfg(tiny_model, tmp_path_factory.mktemp("run")), str(tiny_model),
                         device="cpu")


def _params(tr: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tr.model.state_dict().items()}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                       b.view(torch.int32) if b.dtype == torch.float32 else b)  # NaN-safe


# ------------------------------------------------------------------ packing and masks
def test_pack_groups_flattens_completions_and_normalises_rewards():
    groups = _groups()
    pb = pack_groups(groups, scale_rewards=True, std_eps=1e-6)
    assert len(pb.sequences) == 8 and pb.rewards.shape == (2, 4)
    g, c = groups[1], groups[1].completions[2]
    np.testing.assert_array_equal(pb.sequences[6], np.concatenate([g.prompt_token_ids,
                                                                   c.token_ids]))
    assert pb.prompt_lens == [5] * 4 + [8] * 4
    np.testing.assert_array_equal(pb.behaviour[6], c.logprobs)
    adv = pb.advantages.reshape(2, 4)
    assert torch.allclose(adv.mean(1), torch.zeros(2), atol=1e-6)
    assert torch.allclose(adv.std(1), torch.ones(2), atol=1e-4)
    assert torch.equal(adv[1] > 0, torch.tensor([True, False, False, True]))


def test_pack_groups_rejects_mixed_group_sizes():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="different sizes"):
        pack_groups([_group(rng, "a", 3, [1, 2], [0, 1]), _group(rng, "b", 3, [1], [0])],
                    True, 1e-6)


def test_collate_masks_prompt_and_padding_and_aligns_behaviour():
    groups = _groups()
    pb = pack_groups(groups, True, 1e-6)
    rows = [0, 2, 6, 5]
    pad = 257
    b = collate(pb, rows, pad_id=pad)
    L = max(len(pb.sequences[i]) for i in rows)
    T = max(len(pb.sequences[i]) - pb.prompt_lens[i] for i in rows)
    assert b["input_ids"].shape == (4, L) and b["select"].shape == (4, L - 1)
    assert b["mask"].shape == (4, T) and b["behaviour"].shape == (4, T)
    for r, i in enumerate(rows):
        seq, p = pb.sequences[i], pb.prompt_lens[i]
        t = len(seq) - p
        n = len(seq)
        assert b["input_ids"][r, :n].tolist() == seq.tolist()
        assert (b["input_ids"][r, n:] == pad).all()
        assert b["attention_mask"][r].tolist() == [1] * n + [0] * (L - n)
        # Exactly the positions whose *target* (input_ids[:, 1:]) is a completion token.
        want = torch.zeros(L - 1, dtype=torch.bool)
        want[p - 1: p - 1 + t] = True
        assert torch.equal(b["select"][r], want), (r, b["select"][r])
        targets = b["input_ids"][r, 1:][b["select"][r]]
        assert targets.tolist() == pb.sequences[i][p:].tolist()
        # The loss side: the completion grid, left-aligned.
        assert b["mask"][r].tolist() == [True] * t + [False] * (T - t)
        assert torch.equal(b["behaviour"][r, :t], torch.from_numpy(np.asarray(pb.behaviour[i])))
        assert (b["behaviour"][r, t:] == 0).all()
    assert torch.equal(b["advantages"], pb.advantages[rows])


def test_collate_masks_non_finite_behaviour_tokens():
    groups = _groups()
    groups[0].completions[1].logprobs[2] = -np.inf
    pb = pack_groups(groups, True, 1e-6)
    for b in (collate(pb, [1], pad_id=0), collate_packed(pb, [1])):
        p = pb.prompt_lens[1]
        assert b["select"][0].sum() == 5 and not b["select"][0, p - 1 + 2]
        assert b["mask"][0].sum() == 5 and not b["mask"][0, 2]
        assert b["behaviour"][0, 2] == 0  # masked: a finite placeholder


def test_collate_packed_concatenates_without_padding():
    pb = pack_groups(_groups(), True, 1e-6)
    rows = [6, 0, 3]
    b = collate_packed(pb, rows)
    seqs = [pb.sequences[i] for i in rows]
    total = sum(len(s) for s in seqs)
    assert b["input_ids"].shape == (1, total) and "attention_mask" not in b
    assert b["input_ids"][0].tolist() == np.concatenate(seqs).tolist()
    assert b["position_ids"][0].tolist() == [k for s in seqs for k in range(len(s))]
    # Selected targets, read in order, are the completions, row by row: the grid's order.
    targets = b["input_ids"][0, 1:][b["select"][0]]
    assert targets.tolist() == [x for i in rows for x in pb.sequences[i][pb.prompt_lens[i]:]]
    padded = collate(pb, rows, pad_id=0)
    for k in ("mask", "behaviour", "advantages"):
        assert torch.equal(b[k], padded[k]), k


def test_plan_micro_batches_by_rows_and_by_tokens():
    lengths = [10, 3, 7, 2, 9, 4]
    rows = list(range(6))
    assert plan_micro_batches(lengths, rows, 4, 0, packed=False) == [[0, 1, 2, 3], [4, 5]]
    packed = plan_micro_batches(lengths, rows, 4, 16, packed=True)
    assert sorted(r for mb in packed for r in mb) == rows
    assert all(sum(lengths[r] for r in mb) <= 16 for mb in packed)
    assert len(packed) == 3  # 35 tokens in bins of 16: first-fit decreasing needs three
    padded = plan_micro_batches(lengths, rows, 4, 20, packed=False)
    assert all(len(mb) * max(lengths[r] for r in mb) <= 20 for mb in padded)
    # A row longer than the budget trains alone; an empty slice plans nothing.
    assert [0] in plan_micro_batches(lengths, rows, 4, 8, packed=True)
    assert plan_micro_batches(lengths, [], 4, 8, packed=True) == []


# ------------------------------------------------------------------ logprobs
def test_token_logprobs_equal_full_log_softmax(trainer):
    pb = pack_groups(_groups(), True, 1e-6)
    b = collate(pb, list(range(8)), trainer.pad_id)
    b["mask"] = b["select"]
    with torch.no_grad():
        lp = token_logprobs(trainer.model, b["input_ids"], b["attention_mask"], b["mask"])
        logits = trainer.model(input_ids=b["input_ids"],
                               attention_mask=b["attention_mask"]).logits[:, :-1].float()
    full = torch.log_softmax(logits, -1).gather(-1, b["input_ids"][:, 1:, None]).squeeze(-1)
    assert lp.shape == b["mask"].shape
    m = b["mask"]
    torch.testing.assert_close(lp[m], full[m], atol=1e-5, rtol=1e-5)
    assert (lp[~m] == 0).all()
    assert (lp[m] < 0).all()


# ------------------------------------------------------------------ steps
def test_normal_step_changes_weights_with_finite_metrics(tiny_model, tmp_path):
    tr = PolicyTrainer(_cfg(tiny_model, tmp_path), str(tiny_model), device="cpu")
    before = _params(tr)
    m = tr.step(_groups(), learner_version=2)
    assert m["skipped_nonfinite"] == 0
    for k, v in m.items():
        assert math.isfinite(v), (k, v)
    assert m["grad_norm"] > 0 and m["trained_tokens"] == 31
    assert m["staleness_max"] == 2 and m["token_staleness_mean"] == 2
    assert m["reward_mean"] == pytest.approx(np.mean([0, 1, .5, .2, 1, 0, 0, 1]))
    assert "loss/loss" in m and "reward/length" in m
    after = _params(tr)
    changed = [k for k in before if not _same(before[k], after[k])]
    assert changed and all(torch.isfinite(after[k]).all() for k in after)


def test_nan_parameter_step_is_skipped_and_weights_unchanged(tiny_model, tmp_path):
    tr = PolicyTrainer(_cfg(tiny_model, tmp_path), str(tiny_model), device="cpu")
    with torch.no_grad():
        tr.model.base_model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    before = _params(tr)
    m = tr.step(_groups(), learner_version=0)
    assert m["skipped_nonfinite"] == 1
    after = _params(tr)
    assert all(_same(before[k], after[k]) for k in before)
    assert not tr.optimizer.state  # no moment estimates were written either
    assert all(p.grad is None for p in tr.model.parameters())


def test_nan_reward_step_is_skipped_then_training_recovers(tiny_model, tmp_path):
    tr = PolicyTrainer(_cfg(tiny_model, tmp_path), str(tiny_model), device="cpu")
    groups = _groups()
    groups[0].completions[0].reward = float("nan")
    before = _params(tr)
    m = tr.step(groups, learner_version=0)
    assert m["skipped_nonfinite"] == 1
    assert all(_same(before[k], after) for k, after in _params(tr).items())
    m = tr.step(_groups(1), learner_version=0)  # the next good batch trains normally
    assert m["skipped_nonfinite"] == 0 and math.isfinite(m["grad_norm"])
    assert any(not _same(before[k], v) for k, v in _params(tr).items())


# ------------------------------------------------------------------ snapshots
def test_snapshot_tensors_excludes_frozen_params(tiny_model, tmp_path):
    tr = PolicyTrainer(_cfg(tiny_model, tmp_path, **{"train.freeze_layers": 1}),
                       str(tiny_model), device="cpu")
    snap = tr.snapshot_tensors()
    names = set(tr.model.state_dict())
    frozen = {n for n in names if n.startswith(("model.embed_tokens.", "model.layers.0."))}
    assert frozen and not frozen & set(snap)
    assert any(n.startswith("model.layers.1.") for n in snap)
    assert "model.norm.weight" in snap and "lm_head.weight" in snap  # untied tiny model
    assert set(snap) == {n for n, p in tr.model.named_parameters() if p.requires_grad}
    assert all(v.dtype == tr.snapshot_dtype for v in snap.values())
    before = _params(tr)
    assert tr.step(_groups(), 0)["skipped_nonfinite"] == 0
    after = _params(tr)
    assert all(_same(before[n], after[n]) for n in frozen)
    assert any(not _same(before[n], after[n]) for n in snap)
    # Full snapshot without freezing: every parameter travels.
    full = PolicyTrainer(_cfg(tiny_model, tmp_path), str(tiny_model), device="cpu")
    assert set(full.snapshot_tensors()) == {n for n, _ in full.model.named_parameters()}


def test_freeze_more_layers_than_the_model_has(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="freeze_layers"):
        PolicyTrainer(_cfg(tiny_model, tmp_path, **{"train.freeze_layers": 3}),
                      str(tiny_model), device="cpu")


def test_state_round_trip_restores_weights_and_optimizer(tiny_model, tmp_path):
    a = PolicyTrainer(_cfg(tiny_model, tmp_path), str(tiny_model), device="cpu")
    a.step(_groups(), 0)
    b = PolicyTrainer(_cfg(tiny_model, tmp_path), str(tiny_model), device="cpu")
    f = io.BytesIO()  # as in a checkpoint (in memory, load_state_dict aliases optimizer state)
    torch.save(a.state(), f)
    f.seek(0)
    b.load_state(torch.load(f, weights_only=True))
    ma, mb = a.step(_groups(1), 1), b.step(_groups(1), 1)
    assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-5)
    pa, pb = _params(a), _params(b)
    assert all(_same(pa[k], pb[k]) for k in pa)


# ------------------------------------------------------------------ layouts give the same step
def _grads(tr: PolicyTrainer, groups: list[RolloutGroup]) -> tuple[dict, dict]:
    metrics = tr.accumulate_gradients(groups)
    grads = {n: p.grad.detach().clone() for n, p in tr.model.named_parameters()
             if p.grad is not None}
    tr.optimizer.zero_grad(set_to_none=True)
    return metrics, grads


def _assert_same_step(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    (ma, ga), (mb, gb) = a, b
    assert ma.keys() == mb.keys() and ga.keys() == gb.keys() and ga
    for k in ma:
        assert ma[k] == pytest.approx(mb[k], rel=1e-5, abs=1e-6), k
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], atol=1e-5, rtol=1e-5, msg=n)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_packed_token_budget_step_equals_padded_rows(tiny_model, tmp_path, agg):
    """Packing (one row, no padding, position ids) with token-budget micro-batches and chunked
    logprobs computes the loss, metrics and gradients of the padded row-count path (in fp32:
    bf16 autocast rounds differently for different shapes)."""
    over = {"train.loss.agg": agg, "model.dtype": "float32"}
    padded = PolicyTrainer(_cfg(tiny_model, tmp_path, **over, **{"train.logprob_chunk": 0}),
                           str(tiny_model), device="cpu")
    packed = PolicyTrainer(_cfg(tiny_model, tmp_path, **over, **{
        "train.packing": True, "train.micro_batch_tokens": 24, "train.logprob_chunk": 5}),
        str(tiny_model), device="cpu")
    groups = _groups()
    _assert_same_step(_grads(padded, groups), _grads(packed, groups))


def test_chunked_logprobs_equal_whole_and_keep_gradients(trainer):
    pb = pack_groups(_groups(), True, 1e-6)
    b = collate(pb, list(range(8)), trainer.pad_id)
    out = []
    for chunk in (0, 4):
        trainer.model.zero_grad(set_to_none=True)
        lp = token_logprobs(trainer.model, b["input_ids"], b["attention_mask"], b["select"],
                            chunk=chunk)
        lp.sum().backward()
        out.append((lp.detach(), trainer.model.lm_head.weight.grad.clone()))
    trainer.model.zero_grad(set_to_none=True)
    torch.testing.assert_close(out[0][0], out[1][0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[0][1], out[1][1], atol=1e-6, rtol=1e-6)


def test_masked_tool_tokens_do_not_shrink_the_gradient(tiny_model, tmp_path):
    """An episode's tool tokens (masked spans) are context only: the loss is normalised by the
    sampled tokens, so at staleness 0 the ratio is 1 and the step equals one over the same
    sequences whose tool tokens are simply not targets (non-finite behaviour logprobs)."""
    tr = PolicyTrainer(_cfg(tiny_model, tmp_path, **{"model.dtype": "float32"}),
                       str(tiny_model), device="cpu")
    tool = _groups()
    for g in tool:
        for c in g.completions:
            c.logprobs = np.zeros(len(c.token_ids), dtype=np.float32)
            if len(c.token_ids) >= 3:
                c.masked_spans = [(1, 3)]
    ref = _groups()
    for g in ref:
        for c in g.completions:
            c.logprobs = np.zeros(len(c.token_ids), dtype=np.float32)
            if len(c.token_ids) >= 3:
                c.logprobs[1:3] = np.nan
    a, b = _grads(tr, tool), _grads(tr, ref)
    _assert_same_step(a, b)
    assert a[0]["ratio_mean"] == pytest.approx(1.0)
    pb = pack_groups(tool, True, 1e-6)
    sampled = sum(pb.loss_tokens(i) for i in range(len(pb.sequences)))
    m = tr.step(tool, learner_version=0)
    assert m["trained_tokens"] == sampled and m["tool_tokens"] == 31 - sampled
    assert m["completion_len_mean"] == pytest.approx(sampled / 8)
    assert m["tool_len_mean"] == pytest.approx((31 - sampled) / 8)


def test_step_reports_learner_throughput(trainer):
    m = trainer.step(_groups(), learner_version=0)
    assert m["learner_tokens"] == 31 + 4 * 5 + 4 * 8  # prompts included
    assert m["learner_tokens_per_s"] == pytest.approx(m["learner_tokens"] / m["train_s"])
    assert "mfu" not in m  # no peak FLOP/s on a CPU


def test_a_checkpoint_holds_its_steps_state_while_the_next_step_trains(trainer, tmp_path,
                                                                       monkeypatch):
    """The copy to host overlaps the next step (a slow copy here: a test double for a long
    device-to-host copy); that step's optimiser update waits for it (``before_update``), so the
    checkpoint holds the state of its own step, as a synchronous save does, not the next one's."""
    import asyncio
    import threading

    from pipeline.learner import checkpoint as ck

    trainer.step(_groups(), learner_version=0)  # AdamW's state exists
    sync = ck.save_checkpoint(tmp_path / "sync", ck.LearnerState(step=1), trainer.state(), b"")
    release = threading.Event()
    real = ck._copy_pairs

    def slow_copy(pairs):
        assert release.wait(30)
        real(pairs)

    monkeypatch.setattr(ck, "_copy_pairs", slow_copy)
    w = ck.CheckpointWriter(tmp_path / "async")
    nbytes, count, cuda = trainer.checkpoint_plan()
    w.prepare(nbytes, count, pin=cuda)

    async def main():
        assert await w.save(ck.LearnerState(step=1), trainer.state, b"", lambda p: None) < 5
        step = asyncio.create_task(asyncio.to_thread(trainer.step, _groups(1), 1))
        await asyncio.sleep(0.5)
        assert not step.done()  # forward and backward ran; the update waits for the copy
        release.set()
        await step
        await w.wait()

    trainer.before_update = w.fence
    try:
        asyncio.run(main())
    finally:
        trainer.before_update = None
    want, got = ck.load_checkpoint(sync)[1], ck.load_checkpoint(w.written)[1]
    assert w.staging.buffers and w.staging.used <= w.staging.block.numel()  # one block, reused
    for part in ("model", "optimizer"):
        flat_w = [t for s in (want[part]["state"].values() if part == "optimizer" else
                              [want[part]]) for t in s.values()]
        flat_g = [t for s in (got[part]["state"].values() if part == "optimizer" else
                              [got[part]]) for t in s.values()]
        assert len(flat_w) == len(flat_g) and all(_same(a, b) for a, b in
                                                   zip(flat_w, flat_g, strict=True))
    now = trainer.model.state_dict()
    assert any(not _same(now[k], want["model"][k]) for k in now)  # the next step changed them


def test_plain_model_state_is_accelerates_without_its_unwrap(trainer):
    """The plain learner reads its state dict itself (accelerate's unwrap_model imports
    DeepSpeed to test for it: seconds in every learner process that checkpoints)."""
    from pipeline.learner.trainer import _unwrap

    ours = trainer.state()["model"]
    theirs = {k.removeprefix("model."): v
              for k, v in trainer.accelerator.get_state_dict(trainer.policy).items()}
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    ddp_like = torch.nn.parallel.DistributedDataParallel.__new__(
        torch.nn.parallel.DistributedDataParallel)
    torch.nn.Module.__init__(ddp_like)
    ddp_like.module = trainer.policy
    assert _unwrap(ddp_like) is trainer.policy and _unwrap(trainer.policy) is trainer.policy
