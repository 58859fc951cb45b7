"""GRPO loss against hand-computed cases."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.learner.loss import LossConfig, degenerate_mask, group_advantages, grpo_loss

PPO = LossConfig(off_policy="ppo")
DECOUPLED = LossConfig(off_policy="decoupled")


def leaf(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# --- advantages -------------------------------------------------------------------------------


def test_group_advantages_scaled():
    # mean 0.25, sample std sqrt(0.75 / 3) = 0.5
    adv = group_advantages(t([[1.0, 0.0, 0.0, 0.0]]), eps=0.0)
    torch.testing.assert_close(adv, t([[1.5, -0.5, -0.5, -0.5]]))


def test_group_advantages_unscaled():
    adv = group_advantages(t([[1.0, 0.0, 0.0, 0.0], [2.0, 4.0, 6.0, 8.0]]), scale=False)
    torch.testing.assert_close(adv, t([[0.75, -0.25, -0.25, -0.25], [-3.0, -1.0, 1.0, 3.0]]))


def test_group_advantages_degenerate_is_exactly_zero():
    rewards = t([[0.1, 0.1, 0.1], [1.0, 0.0, 1.0], [7.3, 7.3, 7.3]])
    for scale in (True, False):
        adv = group_advantages(rewards, scale=scale)
        assert torch.isfinite(adv).all()
        assert (adv[0] == 0).all() and (adv[2] == 0).all()
        assert (adv[1] != 0).all()
    assert degenerate_mask(rewards).tolist() == [True, False, True]


def test_group_advantages_group_of_one_is_zero_not_nan():
    adv = group_advantages(t([[3.0], [5.0]]))
    assert (adv == 0).all()


def test_group_advantages_flat_with_group_size():
    flat = group_advantages(t([1.0, 0.0, 0.0, 2.0, 2.0, 2.0]), group_size=3, scale=False)
    torch.testing.assert_close(flat, t([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]))
    with pytest.raises(ValueError):
        group_advantages(t([1.0, 2.0, 3.0]), group_size=2)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.lists(st.floats(-10, 10, allow_nan=False), min_size=4, max_size=4),
        min_size=1,
        max_size=5,
    ),
    st.booleans(),
)
def test_group_advantages_finite_and_centred(rows, scale):
    adv = group_advantages(t(rows), scale=scale)
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv.sum(dim=1), torch.zeros(len(rows), dtype=torch.float64))


# --- clipping ---------------------------------------------------------------------------------


def test_ppo_clipping_both_sides_both_signs():
    # One token per completion; behaviour 0 so the ratio is exp(logprobs).
    r = [1.5, 0.5, 0.5, 1.5]
    lp = leaf([[math.log(x)] for x in r])
    adv = t([1.0, 1.0, -1.0, -1.0])
    out = grpo_loss(lp, torch.zeros_like(lp), adv, torch.ones_like(lp), PPO)
    # per token: -min(rA, clip(r, 0.8, 1.28) A)
    #   A=+1 r=1.5 -> -1.28 (clipped)    A=+1 r=0.5 -> -0.5
    #   A=-1 r=0.5 ->  0.8  (clipped)    A=-1 r=1.5 ->  1.5
    assert out.loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 1.5) / 4)
    out.loss.backward()
    # d/dlp of -rA is -rA; clipped tokens get no gradient.
    torch.testing.assert_close(lp.grad, t([[0.0], [-0.5], [0.0], [1.5]]) / 4)
    assert out.metrics["clip_frac"] == pytest.approx(0.5)
    assert out.metrics["ratio_mean"] == pytest.approx(1.0)


def test_symmetric_clip_is_standard_ppo():
    cfg = LossConfig(off_policy="ppo", clip_eps_low=0.2, clip_eps_high=0.2)
    lp = leaf([[math.log(1.5)]])
    out = grpo_loss(lp, torch.zeros_like(lp), t([2.0]), torch.ones_like(lp), cfg)
    assert out.loss.item() == pytest.approx(-1.2 * 2.0)


def test_decoupled_clips_against_proximal_not_behaviour():
    # Ratio to proximal is 1.5 (clipped at 1.28); behaviour is far off but only enters via w.
    lp = leaf([[math.log(1.5)]])
    prox = t([[0.0]])
    beh = t([[-math.log(1.5)]])  # w = exp(prox - beh) = 1.5, under the cap
    out = grpo_loss(lp, beh, t([1.0]), torch.ones_like(lp), DECOUPLED, proximal_logprobs=prox)
    assert out.loss.item() == pytest.approx(-1.5 * 1.28)
    out.loss.backward()
    assert lp.grad.item() == 0.0
    assert out.metrics["clip_frac"] == 1.0
    assert out.metrics["is_weight_mean"] == pytest.approx(1.5)


# --- importance weights -----------------------------------------------------------------------


def test_is_weights_truncated_at_cap():
    lp = leaf([[0.0], [0.0]])
    # w_raw = exp(prox - beh) = 3 (capped to 2) and 0.5
    beh = t([[-math.log(3.0)], [math.log(2.0)]])
    out = grpo_loss(lp, beh, t([1.0, 1.0]), torch.ones_like(lp), DECOUPLED)
    assert out.loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, t([[-2.0], [-0.5]]) / 2)
    m = out.metrics
    assert m["is_weight_mean"] == pytest.approx(1.25)
    assert m["is_weight_max"] == pytest.approx(2.0)
    assert m["is_truncated_frac"] == pytest.approx(0.5)
    assert m["mismatch_kl"] == pytest.approx((-math.log(3.0) + math.log(2.0)) / 2)
    assert m["mismatch_abs"] == pytest.approx((math.log(3.0) + math.log(2.0)) / 2)


def test_is_weight_is_detached():
    lp = leaf([[0.0]])
    beh = t([[-0.3]])
    out = grpo_loss(lp, beh, t([1.0]), torch.ones_like(lp), DECOUPLED)
    out.loss.backward()
    # w = exp(0.3), treated as a constant: grad = -w * A
    assert lp.grad.item() == pytest.approx(-math.exp(0.3))


# --- masking ----------------------------------------------------------------------------------


def test_masked_positions_get_no_gradient_and_garbage_does_not_leak():
    mask = t([[0, 1, 1, 0], [0, 0, 1, 1]])  # prompt tokens first, padding last
    nan, inf = float("nan"), float("inf")
    lp = leaf([[nan, -0.5, -1.0, inf], [-inf, 50.0, -0.2, -0.7]])
    beh = t([[inf, -0.4, -1.1, nan], [nan, -inf, -0.3, -0.6]])
    ref = t([[-inf, -0.5, -0.9, nan], [inf, nan, -0.25, -0.5]])
    adv = t([0.7, -1.2])
    for mode in ("ppo", "decoupled"):
        for agg in ("token_mean", "seq_mean"):
            cfg = LossConfig(off_policy=mode, agg=agg, kl_coef=0.1)
            lp.grad = None
            out = grpo_loss(lp, beh, adv, mask, cfg, ref_logprobs=ref)
            out.loss.backward()
            assert torch.isfinite(out.loss)
            assert all(math.isfinite(v) for v in out.metrics.values()), out.metrics
            assert (lp.grad[mask == 0] == 0).all()
            assert torch.isfinite(lp.grad).all()

            # Same result as the clean sub-problem with only the unmasked tokens.
            lp2 = leaf([[-0.5, -1.0], [-0.2, -0.7]])
            out2 = grpo_loss(
                lp2,
                t([[-0.4, -1.1], [-0.3, -0.6]]),
                adv,
                torch.ones(2, 2, dtype=torch.float64),
                cfg,
                ref_logprobs=t([[-0.5, -0.9], [-0.25, -0.5]]),
            )
            out2.loss.backward()
            torch.testing.assert_close(out.loss, out2.loss)
            torch.testing.assert_close(lp.grad[mask == 1], lp2.grad.flatten())
            assert out.metrics == pytest.approx(out2.metrics)


def test_empty_mask_gives_zero_loss_not_nan():
    lp = leaf([[0.1, 0.2]])
    out = grpo_loss(lp, lp.detach(), t([1.0]), torch.zeros_like(lp), DECOUPLED)
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert (lp.grad == 0).all()


# --- aggregation and accumulation -------------------------------------------------------------


def test_seq_mean_aggregation():
    lp = leaf([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = t([[1, 0, 0], [1, 1, 1]])
    adv = t([1.0, -2.0])
    # on-policy: per-token loss = -A; seq means: -1 and 2 -> mean 0.5 (token_mean would be 5/4)
    out = grpo_loss(lp, lp.detach(), adv, mask, LossConfig(agg="seq_mean"))
    assert out.loss.item() == pytest.approx(0.5)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, t([[-1.0, 0, 0], [2 / 3, 2 / 3, 2 / 3]]) / 2)
    tok = grpo_loss(lp, lp.detach(), adv, mask, LossConfig(agg="token_mean"))
    assert tok.loss.item() == pytest.approx((-1.0 + 6.0) / 4)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("mode", ["ppo", "decoupled"])
def test_normalizer_makes_accumulation_equal_one_batch(agg, mode):
    g = torch.Generator().manual_seed(0)
    B, T = 6, 5
    values = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 - 1.0
    beh = values + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).to(torch.float64)
    mask[:, 0] = 1
    cfg = LossConfig(off_policy=mode, agg=agg)

    full = values.clone().requires_grad_(True)
    grpo_loss(full, beh, adv, mask, cfg).loss.backward()

    acc = values.clone().requires_grad_(True)
    norm = mask.sum().item() if agg == "token_mean" else float(B)
    total = 0.0
    for half in (slice(0, 3), slice(3, 6)):
        out = grpo_loss(acc[half], beh[half], adv[half], mask[half], cfg, normalizer=norm)
        out.loss.backward()
        total += out.loss.item()
    torch.testing.assert_close(acc.grad, full.grad)
    assert total == pytest.approx(grpo_loss(values, beh, adv, mask, cfg).loss.item())


# --- reduction to plain GRPO ------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["ppo", "decoupled"])
def test_on_policy_reduces_to_plain_policy_gradient(mode):
    g = torch.Generator().manual_seed(1)
    lp = (torch.randn(3, 4, generator=g, dtype=torch.float64) - 1).requires_grad_(True)
    mask = t([[1, 1, 1, 1], [0, 1, 1, 0], [1, 1, 0, 0]])
    adv = t([0.5, -1.5, 2.0])
    out = grpo_loss(lp, lp.detach(), adv, mask, LossConfig(off_policy=mode))
    out.loss.backward()
    n = mask.sum()
    torch.testing.assert_close(lp.grad, -adv[:, None] * mask / n)
    m = out.metrics
    assert m["ratio_mean"] == pytest.approx(1.0)
    assert m["is_weight_mean"] == pytest.approx(1.0)
    assert m["clip_frac"] == 0.0 and m["is_truncated_frac"] == 0.0
    assert m["mismatch_kl"] == 0.0 and m["mismatch_abs"] == 0.0


# --- KL ---------------------------------------------------------------------------------------


def test_k3_kl_value_and_gradient():
    lp = leaf([[0.0]])
    ref = t([[math.log(2.0)]])
    cfg = LossConfig(kl_coef=0.1)
    out = grpo_loss(lp, lp.detach(), t([0.0]), torch.ones_like(lp), cfg, ref_logprobs=ref)
    k3 = 2.0 - math.log(2.0) - 1.0
    assert out.metrics["kl"] == pytest.approx(k3)
    assert out.loss.item() == pytest.approx(0.1 * k3)
    out.loss.backward()
    # d/dlp [exp(ref - lp) - (ref - lp) - 1] = 1 - exp(ref - lp) = -1
    assert lp.grad.item() == pytest.approx(-0.1)


def test_kl_needs_reference():
    lp = leaf([[0.0]])
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(lp, lp.detach(), t([1.0]), torch.ones_like(lp), LossConfig(kl_coef=0.1))


def test_kl_metric_absent_without_reference():
    lp = leaf([[0.0]])
    out = grpo_loss(lp, lp.detach(), t([1.0]), torch.ones_like(lp), DECOUPLED)
    assert "kl" not in out.metrics
    assert all(isinstance(v, float) for v in out.metrics.values())


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"clip_eps_low": 0.0},
        {"clip_eps_low": 1.0},
        {"clip_eps_high": 0.0},
        {"off_policy": "vtrace"},
        {"is_cap": 0.5},
        {"kl_coef": -0.1},
        {"agg": "sum"},
        {"std_eps": 0.0},
    ],
)
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        LossConfig(**kwargs)


def test_shape_validation():
    lp = leaf([[0.0, 0.0]])
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(lp, lp.detach(), t([1.0, 2.0]), torch.ones_like(lp), PPO)
    with pytest.raises(ValueError, match="mask"):
        grpo_loss(lp, lp.detach(), t([1.0]), torch.ones(1, 3), PPO)
