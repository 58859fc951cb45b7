"""GRPO loss: group-normalised advantages and the clipped, off-policy-corrected policy objective.

This module owns the maths of one learner step and nothing else: pure torch functions, no
optimiser, no model, no I/O. Inputs are per-token logprobs of the *sampled* tokens, shaped (B, T)
with a (B, T) mask that is 1 on completion tokens and 0 on prompt and padding. The policy term is
one of three objectives (``cfg.objective``: PPO's clip, GSPO, CISPO) over a ratio that
``cfg.off_policy`` takes against the behaviour or the proximal logprobs; ``cfg.is_correction``
truncates the behaviour->proximal weight or masks the tokens whose weight is out of bounds.

Invariants:
- Masked positions never contribute to the loss, its gradient or any metric, whatever they hold
  (inf, NaN, garbage): every input is passed through ``torch.where`` on the mask before any
  arithmetic, so no ``0 * inf`` can appear in the forward or the backward pass. Tokens masked
  by ``is_correction: mask`` are cleaned the same way before the policy term (they keep their
  place in the normaliser and the KL).
- With ``max_staleness = 0``, one optimiser step per batch and learner logprobs equal to the
  engine's, every objective and off-policy mode reduces to plain GRPO: importance weight 1,
  ratio 1, gradient ``-A * grad(logpi) / N``.
- Degenerate groups (all rewards equal) get advantages of exactly 0, never NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.config import LossConfig

__all__ = [
    "LossConfig",
    "LossOutput",
    "degenerate_mask",
    "group_advantages",
    "grpo_loss",
]




def degenerate_mask(rewards: torch.Tensor) -> torch.Tensor:
    """(n_groups, G) rewards -> (n_groups,) bool, True where every reward of the group is equal.

    Such groups carry no learning signal in GRPO (all advantages are 0).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (n_groups, G), got shape {tuple(rewards.shape)}")
    return rewards.amax(dim=1) == rewards.amin(dim=1)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    scale: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-normalised advantages: ``r - mean(group)``, optionally ``/ (std(group) + eps)``.

    ``rewards`` is (n_groups, G); a flat (n_groups * G,) tensor is accepted with ``group_size``
    and the result then has the same flat shape. The std is the sample std (Bessel-corrected), as
    in DeepSeekMath and TRL. Degenerate groups (all rewards equal) give exactly 0.
    """
    flat = rewards.dim() == 1
    if flat:
        if group_size is None or group_size <= 0 or rewards.numel() % group_size:
            raise ValueError(
                f"flat rewards of length {rewards.numel()} need a group_size that divides it, "
                f"got {group_size}"
            )
        grouped = rewards.reshape(-1, group_size)
    else:
        if group_size is not None and rewards.shape[-1] != group_size:
            raise ValueError(f"rewards shape {tuple(rewards.shape)} != (n_groups, {group_size})")
        grouped = rewards
    grouped = grouped.to(torch.float32) if not grouped.is_floating_point() else grouped

    degenerate = degenerate_mask(grouped).unsqueeze(1)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale and grouped.shape[1] > 1:
        # Sample std is undefined for G == 1; such groups are degenerate and zeroed below anyway.
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    adv = torch.where(degenerate, torch.zeros_like(centred), centred)
    return adv.reshape(rewards.shape) if flat else adv


@dataclass
class LossOutput:
    """The scalar loss (with grad) and per-step diagnostics (python floats, or 0-d tensors with
    ``tensor_metrics``)."""

    loss: torch.Tensor
    metrics: dict[str, Any] = field(default_factory=dict)


def _check_shape(name: str, t: torch.Tensor | None, shape: torch.Size) -> None:
    if t is not None and t.shape != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def _check_inputs(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                  advantages: torch.Tensor, mask: torch.Tensor, cfg: LossConfig,
                  proximal_logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None,
                  normalizer: float | None) -> None:
    """ValueError unless every input has the shape of ``logprobs`` (advantages: one per row) and
    the reference and normaliser are there and valid when needed."""
    shape = logprobs.shape
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T), got shape {tuple(shape)}")
    _check_shape("behaviour_logprobs", behaviour_logprobs, shape)
    _check_shape("mask", mask, shape)
    _check_shape("proximal_logprobs", proximal_logprobs, shape)
    _check_shape("ref_logprobs", ref_logprobs, shape)
    if advantages.shape != shape[:1]:
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected ({shape[0]},)")
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if normalizer is not None and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")


def _is_mask(m: torch.Tensor, lp: torch.Tensor, beh: torch.Tensor, prox: torch.Tensor,
             cfg: LossConfig) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...]]:
    """``is_correction: mask``: the loss tokens whose proximal / behaviour weight lies in
    [is_mask_low, is_mask_high], and (lp, beh, prox) cleaned outside them as the mask's are, so
    the extreme ratio that got a token masked never reaches an exp in the backward pass.
    Under ``truncate``: None and the inputs unchanged."""
    if cfg.is_correction != "mask":
        return None, (lp, beh, prox)
    w = torch.exp(prox - beh)
    kept = m & (w >= cfg.is_mask_low) & (w <= cfg.is_mask_high)
    return kept, tuple(torch.where(kept, t, torch.zeros_like(t)) for t in (lp, beh, prox))


def _importance(lp: torch.Tensor, beh: torch.Tensor, prox: torch.Tensor,
                kept: torch.Tensor | None, cfg: LossConfig
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-ratio, raw importance weight, applied importance weight) per token. ``ppo``: the
    ratio to the behaviour policy, no separate weight; decoupled: the ratio to the proximal
    policy, weighted by proximal / behaviour truncated at ``cfg.is_cap``. With ``kept``
    (masking) the tokens outside it weigh 0 and the others keep their weight uncapped."""
    if cfg.off_policy == "ppo":
        is_raw = torch.ones_like(beh)
        return lp - beh, is_raw, is_raw if kept is None else kept.to(beh.dtype)
    is_raw = torch.exp(prox - beh)
    applied = is_raw.clamp(max=cfg.is_cap) if kept is None else torch.where(kept, is_raw, 0.0)
    return lp - prox, is_raw, applied


# gspo's sequence log-ratio and cispo's detached log-ratio are clamped at +-this before exp:
# e^20 is far past any clip bound yet finite in float32, so one absurd token or completion (a
# logprob difference of 100) cannot turn the loss or its gradient into inf or NaN.
_LOG_RATIO_CAP = 20.0


def _ppo_clip(log_ratio: torch.Tensor, lp: torch.Tensor, adv: torch.Tensor, kept: torch.Tensor,
              cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's pessimistic clipped surrogate per token: a token whose ratio left the clip range
    in its advantage's direction gets no gradient. Returns (surrogate, ratio, clipped)."""
    # exp's backward multiplies by its result, so a ratio that overflowed to inf gave a NaN
    # gradient even where the clip selects the other branch. The gradient flows through a copy
    # held below the dtype's largest value; the value is exactly exp(log_ratio) as before.
    safe = torch.exp(log_ratio.clamp(max=math.log(torch.finfo(log_ratio.dtype).max) - 1.0))
    ratio = safe + (torch.exp(log_ratio) - safe).detach()
    lo, hi = 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high
    clipped = ((ratio > hi) & (adv > 0)) | ((ratio < lo) & (adv < 0))
    return torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv), ratio, clipped


def _gspo(log_ratio: torch.Tensor, lp: torch.Tensor, adv: torch.Tensor, kept: torch.Tensor,
          cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO-token: each token carries sg(s) * pi / sg(pi), with s = exp(mean log-ratio over the
    completion's ``kept`` tokens): value s, gradient s * grad(logp). The pessimistic clip of s
    is per completion, so a whole completion is clipped or none of it, as in GSPO."""
    n = kept.sum(dim=1, keepdim=True).clamp(min=1)
    log_s = (log_ratio.detach().sum(dim=1, keepdim=True) / n).clamp(-_LOG_RATIO_CAP,
                                                                    _LOG_RATIO_CAP)
    s = torch.exp(log_s) * torch.exp(lp - lp.detach())
    lo, hi = 1.0 - cfg.gspo_eps_low, 1.0 + cfg.gspo_eps_high
    clipped = ((s > hi) & (adv > 0)) | ((s < lo) & (adv < 0))
    return torch.minimum(s * adv, s.clamp(lo, hi) * adv), s.detach(), clipped


def _cispo(log_ratio: torch.Tensor, lp: torch.Tensor, adv: torch.Tensor, kept: torch.Tensor,
           cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO: REINFORCE (A * logp) weighted by the detached, clipped ratio, so the clip bounds a
    token's weight without dropping its gradient as PPO's clip does."""
    ratio = torch.exp(log_ratio.detach().clamp(-_LOG_RATIO_CAP, _LOG_RATIO_CAP))
    lo, hi = 1.0 - cfg.cispo_eps_low, 1.0 + cfg.cispo_eps_high
    return ratio.clamp(lo, hi) * adv * lp, ratio, (ratio < lo) | (ratio > hi)


_OBJECTIVES = {"ppo_clip": _ppo_clip, "gspo": _gspo, "cispo": _cispo}


def _k3_kl(ref: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(ref - lp) - (ref - lp) - 1 (>= 0)."""
    log_ref_ratio = ref - lp
    return torch.exp(log_ref_ratio) - log_ref_ratio - 1.0


def _aggregate(per_token: torch.Tensor, m: torch.Tensor, agg: str,
               normalizer: float | None) -> torch.Tensor:
    """The scalar loss from masked per-token losses: ``token_mean`` (sum over the tokens /
    ``normalizer`` or the mask's tokens) or ``seq_mean`` (each row's mean, summed /
    ``normalizer`` or the row count)."""
    if agg == "token_mean":
        denom = float(normalizer) if normalizer is not None else m.sum().clamp(min=1)
        return per_token.sum() / denom
    seq_means = per_token.sum(dim=1) / m.sum(dim=1).clamp(min=1)
    denom = float(normalizer) if normalizer is not None else per_token.shape[0]
    return seq_means.sum() / denom


@torch.no_grad()
def _diagnostics(m: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor,
                 is_raw: torch.Tensor, is_weight: torch.Tensor, kept: torch.Tensor | None,
                 beh: torch.Tensor, prox: torch.Tensor, kl: torch.Tensor | None,
                 cfg: LossConfig) -> dict[str, torch.Tensor]:
    """Per-step metrics over the mask's tokens: clipping, ratios, importance weights (truncated
    or masked), the behaviour/proximal mismatch and (with a reference) the KL."""
    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    count = m.sum().clamp(min=1).to(ratio.dtype)

    def masked_mean(t: torch.Tensor) -> torch.Tensor:
        return torch.where(m, t, zero).sum() / count

    bounded = ("is_truncated_frac", is_raw > cfg.is_cap) if kept is None else \
        ("is_masked_frac", ~kept)
    diff = beh - prox
    metrics = {
        "clip_frac": masked_mean(clipped.to(ratio.dtype)),
        "ratio_mean": masked_mean(ratio),
        "is_weight_mean": masked_mean(is_weight),
        "is_weight_max": torch.where(m, is_weight, zero).max() if m.numel() else zero,
        bounded[0]: masked_mean(bounded[1].to(ratio.dtype)),
        "mismatch_kl": masked_mean(diff),
        "mismatch_abs": masked_mean(diff.abs()),
    }
    if kl is not None:
        metrics["kl"] = masked_mean(kl)
    return metrics


def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    proximal_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    normalizer: float | None = None,
    tensor_metrics: bool = False,
) -> LossOutput:
    """GRPO policy loss (``cfg.objective``) with an off-policy correction and optional KL.

    Args:
        logprobs: (B, T) learner logprobs of the sampled tokens under current params (with grad).
        behaviour_logprobs: (B, T) engine logprobs at generation time.
        advantages: (B,) one advantage per completion.
        mask: (B, T) 1 on completion tokens, 0 on prompt and padding.
        cfg: loss knobs.
        proximal_logprobs: (B, T) learner logprobs before this optimiser step (no grad). None means
            ``logprobs.detach()``, right when each batch gets one optimiser step.
        ref_logprobs: (B, T) frozen-reference logprobs, required when ``cfg.kl_coef > 0``.
        normalizer: for gradient accumulation over micro-batches, the whole batch's denominator:
            total mask tokens (``token_mean``) or total completions (``seq_mean``). Default: this
            micro-batch's own (``mask.sum()`` or ``B``).
        tensor_metrics: metrics as 0-d tensors on the loss's device instead of floats, so a
            loop over micro-batches never waits for the device (one sync at the end).

    Returns:
        LossOutput with the scalar loss and metrics computed over this call's mask tokens.
    """
    _check_inputs(logprobs, behaviour_logprobs, advantages, mask, cfg, proximal_logprobs,
                  ref_logprobs, normalizer)
    m = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)

    def clean(t: torch.Tensor) -> torch.Tensor:
        # Replace masked positions before any arithmetic: where() routes no gradient to the
        # unselected branch, so inf/NaN there cannot leak into the loss or its backward pass.
        return torch.where(m, t.to(logprobs.dtype), zero)

    lp = clean(logprobs)
    beh = clean(behaviour_logprobs).detach()
    prox = lp.detach() if proximal_logprobs is None else clean(proximal_logprobs).detach()
    adv = advantages.to(logprobs.dtype).detach().unsqueeze(1)
    kept, pg = _is_mask(m, lp, beh, prox, cfg)
    log_ratio, is_raw, is_weight = _importance(*pg, kept, cfg)
    surrogate, ratio, clipped = _OBJECTIVES[cfg.objective](
        log_ratio, pg[0], adv, m if kept is None else kept, cfg)
    per_token = -is_weight * surrogate
    kl = None
    if ref_logprobs is not None:
        kl = _k3_kl(clean(ref_logprobs).detach(), lp)
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl
    loss = _aggregate(torch.where(m, per_token, zero), m, cfg.agg, normalizer)

    metrics = {"loss": loss.detach(),
               **_diagnostics(m, ratio, clipped, is_raw, is_weight, kept, beh, prox, kl, cfg)}
    if not tensor_metrics:
        metrics = {k: float(v) for k, v in metrics.items()}
    return LossOutput(loss=loss, metrics=metrics)
