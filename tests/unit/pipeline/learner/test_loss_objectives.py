"""The policy objectives (PPO clip, GSPO, CISPO) and the importance corrections (TIS, masked IS)
against numpy float64 references of their papers' formulas, values and gradients; the default
objective pinned bit for bit to the computation it had before objectives were selectable."""

import numpy as np
import pytest
import torch

from pipeline.learner.loss import LossConfig, grpo_loss
from pipeline.options import ConfigError

LENGTHS = [1, 3, 8, 5, 2, 7]  # completion lengths of a batch: one token up to the whole grid
T = 8


def batch(seed: int, spread) -> tuple[np.ndarray, ...]:
    """(lp, beh, adv, mask) with completions of LENGTHS; ``spread`` scales lp - beh (one per
    row, or one for all)."""
    g = np.random.default_rng(seed)
    lp = g.normal(-1.5, 0.7, (len(LENGTHS), T))
    beh = lp - g.normal(0.0, 1.0, lp.shape) * np.broadcast_to(spread, (len(LENGTHS),))[:, None]
    adv = g.normal(0.0, 1.0, len(LENGTHS))
    mask = (np.arange(T)[None, :] < np.asarray(LENGTHS)[:, None]).astype(float)
    return lp, beh, adv, mask


def run(lp, beh, adv, mask, cfg, prox=None, dtype=torch.float64):
    """grpo_loss on numpy inputs, NaN in the padding -> (loss, gradient, metrics)."""
    def grid(a):
        return torch.tensor(np.where(mask > 0, a, np.nan), dtype=dtype)

    x = grid(lp).requires_grad_(True)
    out = grpo_loss(x, grid(beh), torch.tensor(adv, dtype=dtype), torch.tensor(mask, dtype=dtype),
                    cfg, proximal_logprobs=None if prox is None else grid(prox))
    out.loss.backward()
    assert (x.grad[torch.tensor(mask) == 0] == 0).all()
    return out.loss.item(), x.grad.double().numpy(), out.metrics


def close(got, want, rtol=1e-10, atol=1e-12):
    np.testing.assert_allclose(got[0], want[0], rtol=rtol, atol=atol)
    np.testing.assert_allclose(got[1], want[1], rtol=rtol, atol=atol)


# --- numpy references (float64), each the paper's formula ------------------------------------


def np_aggregate(per, dper, mask, agg):
    """Loss and gradient from per-token losses ``per`` and their derivatives ``dper`` by the
    token's own logprob: the batch's token mean, or the mean over completions of their mean."""
    per, dper = np.where(mask > 0, per, 0.0), np.where(mask > 0, dper, 0.0)
    if agg == "token_mean":
        n = max(mask.sum(), 1.0)
        return per.sum() / n, dper / n
    n = np.maximum(mask.sum(1, keepdims=True), 1.0) * mask.shape[0]
    return (per / n).sum(), dper / n


def np_ppo_clip(lp, old, adv, mask, lo, hi, w=1.0, agg="token_mean"):
    """PPO: -w * min(r A, clip(r, lo, hi) A), r = pi / pi_old; no gradient where clipped."""
    with np.errstate(over="ignore"):
        r = np.exp(lp - old)
    a = adv[:, None]
    unclipped, clipped = r * a, np.clip(r, lo, hi) * a
    per = -w * np.minimum(unclipped, clipped)
    return np_aggregate(per, np.where(clipped < unclipped, 0.0, -w * a * r), mask, agg)


def np_gspo(lp, old, adv, mask, lo, hi, agg="token_mean"):
    """GSPO: J_i = min(s_i A_i, clip(s_i, lo, hi) A_i), s_i = exp(mean over the completion's
    tokens of log pi / pi_old); the loss is -J_i averaged over completions (seq_mean) or over
    tokens, each completion weighing its length (token_mean)."""
    n = mask.sum(1)
    with np.errstate(over="ignore"):
        s = np.exp(np.where(mask > 0, lp - old, 0.0).sum(1) / np.maximum(n, 1))
    unclipped, clipped = s * adv, np.clip(s, lo, hi) * adv
    j = np.where(n > 0, np.minimum(unclipped, clipped), 0.0)
    dj = np.where(clipped < unclipped, 0.0, adv * s)  # dJ_i / d(mean log-ratio)
    c = n / max(n.sum(), 1) if agg == "token_mean" else np.full(len(n), 1 / len(n))
    return -(c * j).sum(), -(c * dj / np.maximum(n, 1))[:, None] * mask


def np_cispo(lp, old, adv, mask, lo, hi, agg="token_mean"):
    """CISPO: -sg(clip(r, lo, hi)) * A * log pi per token."""
    with np.errstate(over="ignore"):
        w = np.clip(np.exp(lp - old), lo, hi)
    return np_aggregate(-w * adv[:, None] * lp, -w * adv[:, None], mask, agg)


# --- GSPO -------------------------------------------------------------------------------------


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_matches_the_paper(agg, seed):
    # Per-row spreads: some sequence ratios inside the tiny clip range, some far outside it.
    lp, beh, adv, mask = batch(seed, [1e-5, 1e-4, 1e-4, 0.3, 1e-3, 0.05])
    cfg = LossConfig(objective="gspo", off_policy="ppo", agg=agg)
    lo, hi = 1 - cfg.gspo_eps_low, 1 + cfg.gspo_eps_high
    loss, grad, metrics = run(lp, beh, adv, mask, cfg)
    close((loss, grad), np_gspo(lp, beh, adv, mask, lo, hi, agg))

    s = np.exp(((lp - beh) * mask).sum(1) / mask.sum(1))
    clipped = ((s > hi) & (adv > 0)) | ((s < lo) & (adv < 0))
    assert clipped.any() and not clipped.all()
    n = mask.sum(1)
    assert metrics["clip_frac"] == pytest.approx((clipped * n).sum() / n.sum())
    assert metrics["ratio_mean"] == pytest.approx((s * n).sum() / n.sum())


def test_gspo_clips_a_whole_completion_at_once():
    # Token ratios 2 and 0.5: each far outside PPO's range, their geometric mean exactly 1.
    lp = np.log([[2.0, 0.5]])
    loss, grad, metrics = run(lp, np.zeros_like(lp), np.array([1.0]), np.ones_like(lp),
                              LossConfig(objective="gspo", off_policy="ppo"))
    assert loss == pytest.approx(-1.0)
    np.testing.assert_allclose(grad, [[-0.5, -0.5]])  # s * A / N on each token, neither dropped
    assert metrics["clip_frac"] == 0.0


def test_gspo_on_one_token_completions_is_ppo_clip_with_its_bounds():
    lp, beh, adv, _ = batch(3, 2e-4)
    mask = np.zeros_like(lp)
    mask[:, 0] = 1
    gspo = LossConfig(objective="gspo", off_policy="ppo")
    ppo = LossConfig(off_policy="ppo", clip_eps_low=gspo.gspo_eps_low,
                     clip_eps_high=gspo.gspo_eps_high)
    close(run(lp, beh, adv, mask, gspo)[:2], run(lp, beh, adv, mask, ppo)[:2])


# --- CISPO ------------------------------------------------------------------------------------


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("eps", [(1.0, 4.0), (0.2, 0.28)])
def test_cispo_matches_the_paper(agg, eps):
    lp, beh, adv, mask = batch(4, 1.5)
    cfg = LossConfig(objective="cispo", off_policy="ppo", agg=agg, cispo_eps_low=eps[0],
                     cispo_eps_high=eps[1])
    lo, hi = 1 - eps[0], 1 + eps[1]
    loss, grad, metrics = run(lp, beh, adv, mask, cfg)
    close((loss, grad), np_cispo(lp, beh, adv, mask, lo, hi, agg))

    r = np.exp(lp - beh)
    clipped = ((r < lo) | (r > hi)) & (mask > 0)
    assert clipped.any()
    assert metrics["clip_frac"] == pytest.approx(clipped.sum() / mask.sum())
    # The clip bounds the weight; no token loses its gradient.
    assert (grad[mask > 0] != 0).all()


# --- importance corrections -------------------------------------------------------------------


def test_tis_applies_in_sync_mode():
    # Sync mode: the trainer passes no proximal logprobs (one optimiser step per batch, staleness
    # 0), the engine's logprobs differ from the learner's only by their mismatch.
    lp, beh, adv, mask = batch(5, 1.0)
    cfg = LossConfig()  # off_policy decoupled, is_correction truncate, is_cap 2
    loss, grad, metrics = run(lp, beh, adv, mask, cfg)
    w = np.exp(lp - beh)
    close((loss, grad), np_ppo_clip(lp, lp, adv, mask, 0.8, 1.28, w=np.minimum(w, cfg.is_cap)))
    truncated = (w > cfg.is_cap) & (mask > 0)
    assert 0 < truncated.sum() < mask.sum()
    assert metrics["is_truncated_frac"] == pytest.approx(truncated.sum() / mask.sum())
    assert "is_masked_frac" not in metrics


@pytest.mark.parametrize("off_policy", ["decoupled", "ppo"])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_masked_importance_sampling_matches_reference(off_policy, agg):
    lp, beh, adv, mask = batch(6, 1.0)
    prox = lp + np.random.default_rng(7).normal(0, 0.1, lp.shape)  # a later optimiser step
    cfg = LossConfig(off_policy=off_policy, is_correction="mask", agg=agg)
    loss, grad, metrics = run(lp, beh, adv, mask, cfg, prox=prox)

    w = np.exp(prox - beh)
    kept = (w >= cfg.is_mask_low) & (w <= cfg.is_mask_high) & (mask > 0)
    assert 0 < kept.sum() < mask.sum()
    if off_policy == "decoupled":  # ratio to the proximal policy, kept tokens weighted by w
        want = np_ppo_clip(lp, prox, adv, mask, 0.8, 1.28, w=np.where(kept, w, 0.0), agg=agg)
    else:  # ratio to the behaviour policy, no separate weight
        want = np_ppo_clip(lp, beh, adv, mask, 0.8, 1.28, w=kept.astype(float), agg=agg)
    close((loss, grad), want)
    assert (grad[(mask > 0) & ~kept] == 0).all()
    assert metrics["is_masked_frac"] == pytest.approx(1 - kept.sum() / mask.sum())
    assert "is_truncated_frac" not in metrics


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo", "cispo"])
def test_a_mask_that_keeps_every_token_changes_nothing(objective):
    lp, beh, adv, mask = batch(8, 0.05)  # every w well inside [0.5, 5]
    base = LossConfig(objective=objective, off_policy="ppo")
    masked = LossConfig(objective=objective, off_policy="ppo", is_correction="mask")
    close(run(lp, beh, adv, mask, masked)[:2], run(lp, beh, adv, mask, base)[:2], rtol=0, atol=0)


# --- the default objective --------------------------------------------------------------------


def ppo_clip_before(lp, beh, adv, mask, cfg, prox=None):
    """The loss exactly as grpo_loss computed it before objectives were selectable (without KL),
    to pin the default bit for bit."""
    m = mask.bool()
    zero = torch.zeros((), dtype=lp.dtype)
    lp = torch.where(m, lp, zero)
    beh = torch.where(m, beh, zero).detach()
    prox = lp.detach() if prox is None else torch.where(m, prox, zero).detach()
    adv = adv.detach().unsqueeze(1)
    if cfg.off_policy == "ppo":
        ratio, w = torch.exp(lp - beh), torch.ones_like(beh)
    else:
        ratio, w = torch.exp(lp - prox), torch.exp(prox - beh).clamp(max=cfg.is_cap)
    lo, hi = 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high
    per_token = torch.where(m, -w * torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv), zero)
    if cfg.agg == "token_mean":
        return per_token.sum() / m.sum().clamp(min=1)
    return (per_token.sum(dim=1) / m.sum(dim=1).clamp(min=1)).sum() / per_token.shape[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("off_policy", ["decoupled", "ppo"])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("with_prox", [False, True])
def test_default_objective_is_bit_identical_to_before(dtype, off_policy, agg, with_prox):
    assert LossConfig().objective == "ppo_clip" and LossConfig().is_correction == "truncate"
    lp, beh, adv, mask = batch(9, 0.5)
    prox = lp + np.random.default_rng(10).normal(0, 0.2, lp.shape) if with_prox else None
    cfg = LossConfig(off_policy=off_policy, agg=agg)

    b, a, m = (torch.tensor(v, dtype=dtype) for v in (beh, adv, mask))
    p = None if prox is None else torch.tensor(prox, dtype=dtype)
    x_new = torch.tensor(lp, dtype=dtype).requires_grad_(True)
    new = grpo_loss(x_new, b, a, m, cfg, proximal_logprobs=p).loss
    new.backward()
    x_old = torch.tensor(lp, dtype=dtype).requires_grad_(True)
    old = ppo_clip_before(x_old, b, a, m, cfg, prox=p)
    old.backward()
    assert torch.equal(new.detach(), old.detach())
    assert torch.equal(x_new.grad, x_old.grad)

    if off_policy == "decoupled":  # ratio to the proximal policy, truncated weight to it
        old_lp = lp if prox is None else prox
        want = np_ppo_clip(lp, old_lp, adv, mask, 0.8, 1.28, agg=agg,
                           w=np.minimum(np.exp(old_lp - beh), cfg.is_cap))
    else:
        want = np_ppo_clip(lp, beh, adv, mask, 0.8, 1.28, agg=agg)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    close((new.item(), x_new.grad.double().numpy()), want, rtol=tol, atol=tol)


# --- every objective: invariants and edge cases ----------------------------------------------

CONFIGS = {
    "ppo_clip/decoupled": {},
    "ppo_clip/ppo": {"off_policy": "ppo"},
    "gspo": {"objective": "gspo", "off_policy": "ppo"},
    "cispo": {"objective": "cispo", "off_policy": "ppo"},
    "ppo_clip/decoupled/mask": {"is_correction": "mask"},
    "gspo/mask": {"objective": "gspo", "off_policy": "ppo", "is_correction": "mask"},
    "cispo/mask": {"objective": "cispo", "off_policy": "ppo", "is_correction": "mask"},
}


@pytest.mark.parametrize("name", CONFIGS)
def test_on_policy_every_objective_is_plain_policy_gradient(name):
    lp, _, adv, mask = batch(11, 0.0)
    _, grad, metrics = run(lp, lp, adv, mask, LossConfig(**CONFIGS[name]))
    np.testing.assert_allclose(grad, -adv[:, None] * mask / mask.sum(), rtol=1e-12)
    assert metrics["ratio_mean"] == pytest.approx(1.0) and metrics["clip_frac"] == 0.0


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_all_tokens_masked_gives_zero_not_nan(name, agg):
    lp, beh, adv, _ = batch(12, 1.0)
    loss, grad, metrics = run(lp, beh, adv, np.zeros_like(lp), LossConfig(**CONFIGS[name],
                                                                          agg=agg))
    assert loss == 0.0 and (grad == 0).all()
    assert all(np.isfinite(v) for v in metrics.values()), metrics


@pytest.mark.parametrize("name", ["ppo_clip/ppo", "gspo", "cispo"])
def test_one_token_completions(name):
    lp, beh, adv, _ = batch(13, 0.5)
    mask = np.zeros_like(lp)
    mask[:, 0] = 1
    cfg = LossConfig(**CONFIGS[name])
    ref = {"ppo_clip/ppo": lambda: np_ppo_clip(lp, beh, adv, mask, 0.8, 1.28),
           "gspo": lambda: np_gspo(lp, beh, adv, mask, 1 - cfg.gspo_eps_low,
                                   1 + cfg.gspo_eps_high),
           "cispo": lambda: np_cispo(lp, beh, adv, mask, 0.0, 5.0)}[name]
    close(run(lp, beh, adv, mask, cfg)[:2], ref())


# Rows of a float32 batch whose logprob differences overflow exp: (advantage, lp - beh).
# In each the reference clips (or the ratio underflows to ~0), so the result is representable.
OVERFLOW_ROWS = [(1.0, 100.0), (-1.0, -100.0), (1.0, -100.0), (0.5, 1e-4)]


def overflow_batch(rows):
    adv = np.array([a for a, _ in rows])
    lp = np.full((len(rows), 3), -0.5)
    beh = lp - np.array([d for _, d in rows])[:, None]
    return lp, beh, adv, np.ones_like(lp)


@pytest.mark.parametrize("name", ["ppo_clip/ppo", "gspo", "cispo"])
def test_float32_overflowing_ratios_are_finite_and_clipped_as_the_reference(name):
    lp, beh, adv, mask = overflow_batch(OVERFLOW_ROWS)
    cfg = LossConfig(**CONFIGS[name])
    loss, grad, _ = run(lp, beh, adv, mask, cfg, dtype=torch.float32)
    assert np.isfinite(loss) and np.isfinite(grad).all()
    ref = {"ppo_clip/ppo": lambda: np_ppo_clip(lp, beh, adv, mask, 0.8, 1.28),
           "gspo": lambda: np_gspo(lp, beh, adv, mask, 1 - cfg.gspo_eps_low,
                                   1 + cfg.gspo_eps_high),
           "cispo": lambda: np_cispo(lp, beh, adv, mask, 0.0, 5.0)}[name]
    close((loss, grad), ref(), rtol=1e-5, atol=1e-6)
    if name != "cispo":  # clipped above with A > 0: no gradient (not NaN)
        assert grad[0].tolist() == [0.0] * 3


@pytest.mark.parametrize("name", ["gspo", "cispo", "gspo/mask", "cispo/mask"])
def test_float32_negative_advantage_on_an_overflowing_ratio_stays_finite(name):
    # A < 0 with a ratio of e^100: PPO's pessimism keeps the unclipped term, which float32
    # cannot hold. cispo clips the weight (as its reference); gspo caps the sequence log-ratio
    # at 20, so the completion weighs e^20 instead of e^100 and pushes the same way.
    lp, beh, adv, mask = overflow_batch([*OVERFLOW_ROWS, (-1.0, 100.0)])
    loss, grad, metrics = run(lp, beh, adv, mask, LossConfig(**CONFIGS[name]),
                              dtype=torch.float32)
    assert np.isfinite(loss) and np.isfinite(grad).all()
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    if name == "cispo":
        close((loss, grad), np_cispo(lp, beh, adv, mask, 0.0, 5.0), rtol=1e-5, atol=1e-6)
    if name == "gspo":
        assert (grad[-1] > 0).all()  # lowers the probability of a negative-advantage completion
    if name.endswith("mask"):  # |lp - beh| = 100 is far outside [0.5, 5]: masked, no gradient
        assert (grad[:3] == 0).all() and metrics["is_masked_frac"] == pytest.approx(12 / 15)


# --- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize("objective", ["gspo", "cispo"])
def test_gspo_and_cispo_refuse_the_decoupled_ratio(objective):
    with pytest.raises(ConfigError, match=rf"^train\.loss\.objective: {objective} needs "
                                          r"off_policy ppo"):
        LossConfig(objective=objective)
    assert LossConfig(objective=objective, off_policy="ppo").objective == objective


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"objective": "dapo"}, "objective"),
        ({"is_correction": "clip"}, "is_correction"),
        ({"gspo_eps_low": 0.0}, "gspo_eps_low"),
        ({"gspo_eps_high": 0.0}, "gspo_eps_high"),
        ({"cispo_eps_low": 1.5}, "cispo_eps_low"),
        ({"cispo_eps_high": 0.0}, "cispo_eps_high"),
        ({"is_mask_low": 1.0}, "is_mask_low"),
        ({"is_mask_high": 1.0}, "is_mask_high"),
    ],
)
def test_new_options_are_validated(kwargs, option):
    with pytest.raises(ConfigError, match=rf"^train\.loss\.{option}: "):
        LossConfig(**kwargs)
