"""Checks of a decoded rollout group against the run it is sent to (pure functions, no I/O).

``buffer.schema.decode`` proves a frame is a well-formed group; this module decides whether that
group fits *this* run: the GRPO group size, the model's vocabulary, the generation and context
lengths, the versions the learner has published, and sane reward and logprob ranges. A group
that fails one check would crash the trainer (a short group, an empty prompt, an out-of-vocab
id) or train on nonsense; the learner rejects it instead (counted as
``rejected_groups/<reason>``), never trains on it, and re-checks a resumed checkpoint's buffer.

Each check returns the first reason that applies (one of :data:`REASONS`) or None. The checks
look at content only: who sent a group (producer identity, sequence numbers) is the transport's
and the ledger's concern.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from buffer.schema import LOGPROB_EPS, RolloutGroup

REASONS = (
    "group_size",
    "empty_prompt",
    "token_out_of_vocab",
    "too_many_tokens",
    "too_long",
    "version_ahead",
    "version_behind",
    "reward_out_of_range",
    "logprob_out_of_range",
)
"""Every reason a group can be rejected for, in the order they are checked."""


@dataclass(frozen=True)
class RunLimits:
    """What a group must fit to be trained in this run (the learner rebuilds it per version)."""

    group_size: int
    """Completions per group (``generation.group_size``): GRPO normalises within a group, and a
    batch of groups of different sizes cannot be packed."""
    vocab_size: int
    """Token ids must be in [0, vocab_size): the model's vocabulary (its embedding rows)."""
    max_tokens: int
    """Most tokens one completion may have (``generation.max_tokens``)."""
    max_model_len: int
    """Most prompt + completion tokens of one sequence (``engine.max_model_len``)."""
    learner_version: int
    """Newest policy version the learner has published: no token can come from a later one."""
    oldest_version: int = 0
    """Oldest policy version a token may carry; older ones come from weights the learner no
    longer keeps and could never train on."""
    min_logprob: float = -1e4
    """Lowest plausible behaviour logprob of a sampled token (exp(-1e4) is never sampled)."""
    max_logprob: float = LOGPROB_EPS
    """Highest behaviour logprob: 0 plus the rounding slack the wire format allows."""
    max_abs_reward: float = 1e9
    """Largest |reward|: beyond it the group's mean and std lose all precision in float32."""

    def __post_init__(self) -> None:
        for name in ("group_size", "vocab_size", "max_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"RunLimits.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.oldest_version <= self.learner_version:
            raise ValueError(
                f"RunLimits: need 0 <= oldest_version ({self.oldest_version}) <= "
                f"learner_version ({self.learner_version})"
            )
        if not self.min_logprob < self.max_logprob:
            raise ValueError("RunLimits.min_logprob must be below max_logprob")
        if not self.max_abs_reward > 0:
            raise ValueError("RunLimits.max_abs_reward must be > 0")


@dataclass(frozen=True)
class Rejection:
    """Why a group was rejected: ``reason`` (one of REASONS) and a one-line ``detail``."""

    reason: str
    detail: str


def check_group(group: RolloutGroup, limits: RunLimits) -> Rejection | None:
    """The first check ``group`` fails against ``limits``, or None if it may be trained."""
    comps = group.completions
    if len(comps) != limits.group_size:
        return Rejection(
            "group_size", f"{len(comps)} completions, the run's group_size is {limits.group_size}"
        )
    prompt = np.asarray(group.prompt_token_ids)
    if prompt.size == 0:
        return Rejection("empty_prompt", "the prompt has no tokens")
    for where, ids in [("prompt", prompt)] + [
        (f"completion {i}", np.asarray(c.token_ids)) for i, c in enumerate(comps)
    ]:
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= limits.vocab_size):
            return Rejection(
                "token_out_of_vocab",
                f"{where} has token ids in [{int(ids.min())}, {int(ids.max())}], "
                f"the vocabulary is [0, {limits.vocab_size})",
            )
    for i, c in enumerate(comps):
        n = len(c.token_ids)
        if n > limits.max_tokens:
            return Rejection(
                "too_many_tokens",
                f"completion {i} has {n} tokens, max_tokens is {limits.max_tokens}",
            )
        if prompt.size + n > limits.max_model_len:
            return Rejection(
                "too_long",
                f"prompt {prompt.size} + completion {i} {n} tokens "
                f"exceed max_model_len {limits.max_model_len}",
            )
    for i, c in enumerate(comps):
        versions = [v for _, v in c.version_segments]
        if max(versions) > limits.learner_version:
            return Rejection(
                "version_ahead",
                f"completion {i} has tokens of version "
                f"{max(versions)}, the learner is at "
                f"{limits.learner_version}",
            )
        if min(versions) < limits.oldest_version:
            return Rejection(
                "version_behind",
                f"completion {i} has tokens of version "
                f"{min(versions)}, the oldest kept is "
                f"{limits.oldest_version}",
            )
    for i, c in enumerate(comps):
        rewards = [c.reward, *c.reward_breakdown.values()]
        if not all(math.isfinite(r) and abs(r) <= limits.max_abs_reward for r in rewards):
            return Rejection(
                "reward_out_of_range",
                f"completion {i} has reward {c.reward} "
                f"(breakdown {c.reward_breakdown}); "
                f"|reward| must be <= "
                f"{limits.max_abs_reward:g}",
            )
    for i, c in enumerate(comps):
        lp = np.asarray(c.logprobs, dtype=np.float64)
        if lp.size and not (
            np.isfinite(lp).all()
            and lp.min() >= limits.min_logprob
            and lp.max() <= limits.max_logprob
        ):
            return Rejection(
                "logprob_out_of_range",
                f"completion {i} has logprobs in [{lp.min()}, {lp.max()}], "
                f"allowed [{limits.min_logprob:g}, {limits.max_logprob:g}]",
            )
    return None
