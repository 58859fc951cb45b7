"""The numbers one training step reports: about its batch (rewards, completion lengths,
staleness), the learner's throughput (tokens per second, MFU through
``pipeline.learner.flops``), and the step's metrics row as the learner logs it (``step_row``:
times, the buffer's counters, the producers' figures, the learner's counters).

Pure functions of the batch (``pipeline.learner.batching.PackedBatch``), its groups and the
figures handed in; the optimiser's own numbers (loss terms, gradient norm, learning rate) are the
trainer's.
Invariants: tool/environment tokens of an episode are context, counted apart from the trained
(loss) tokens; a reward that returned None for a completion leaves it out of its breakdown.
"""

from __future__ import annotations

import numpy as np

from buffer.schema import RolloutGroup
from buffer.store import BufferStats
from pipeline.learner.batching import PackedBatch
from pipeline.learner.flops import ModelShape, train_flops


def batch_metrics(pb: PackedBatch, groups: list[RolloutGroup], loss_tokens: int,
                  learner_version: int) -> dict[str, float]:
    """Rewards, lengths (per completion) and staleness (per group and per token, against
    ``learner_version``) of a batch whose loss tokens number ``loss_tokens``."""
    n = len(pb.sequences)
    completion = [len(s) - p for s, p in zip(pb.sequences, pb.prompt_lens, strict=True)]
    vers = np.concatenate([v for v in pb.versions if len(v)]) if sum(completion) else \
        np.zeros(0)
    stale = staleness(groups, learner_version)
    return {
        "reward_mean": float(pb.rewards.mean()),
        "reward_std": float(pb.rewards.std()) if pb.rewards.numel() > 1 else 0.0,
        "degenerate_frac": float((pb.rewards.amax(1) == pb.rewards.amin(1)).float().mean()),
        "completion_len_mean": loss_tokens / max(n, 1),
        "tool_len_mean": (sum(completion) - loss_tokens) / max(n, 1),
        "trained_tokens": float(loss_tokens),
        "tool_tokens": float(sum(completion) - loss_tokens),
        "staleness_mean": float(np.mean(stale)),
        "staleness_max": float(np.max(stale)),
        "token_staleness_mean": float(np.mean(learner_version - vers)) if len(vers) else 0.0,
    }


def staleness(groups: list[RolloutGroup], learner_version: int) -> list[int]:
    """Each group's staleness: the learner's version minus the one that generated it."""
    return [learner_version - g.policy_version for g in groups]


def staleness_hist(groups: list[RolloutGroup], learner_version: int) -> dict[str, float]:
    """``staleness_hist/<s>``: how many groups of the batch are ``s`` versions stale."""
    hist: dict[str, float] = {}
    for s in staleness(groups, learner_version):
        hist[f"staleness_hist/{s}"] = hist.get(f"staleness_hist/{s}", 0.0) + 1
    return hist


def reward_means(groups: list[RolloutGroup]) -> dict[str, float]:
    """``reward/<name>``: each reward's mean over the completions it scored (a reward that
    returned None for a completion, TRL's "not scored", leaves it out of its breakdown)."""
    sums: dict[str, list[float]] = {}
    for g in groups:
        for c in g.completions:
            for k, v in c.reward_breakdown.items():
                sums.setdefault(k, []).append(v)
    return {f"reward/{k}": float(np.mean(sums[k])) for k in sorted(sums)}


def throughput(pb: PackedBatch, loss_tokens: int, seconds: float, shape: ModelShape | None,
               peak: float | None, world: int) -> dict[str, float]:
    """``learner_tokens`` (every token through the forward, prompts included, all ranks),
    ``learner_tokens_per_s`` and, with the model's ``shape`` and the GPU's ``peak`` FLOP/s known,
    ``learner_tflops`` and ``mfu`` over ``world`` ranks (pipeline.learner.flops)."""
    lengths = pb.lengths()
    out = {"learner_tokens": float(sum(lengths)),
           "learner_tokens_per_s": sum(lengths) / max(seconds, 1e-9)}
    if shape is not None and peak is not None:
        flops = train_flops(shape, lengths, loss_tokens)
        out["learner_tflops"] = flops / max(seconds, 1e-9) / 1e12
        out["mfu"] = flops / (max(seconds, 1e-9) * peak * world)
    return out


def step_row(m: dict[str, float], *, version: int, wait_s: float, step_s: float, samples: int,
             buffer_size: int, buffer_stats: BufferStats, producers: dict[str, float],
             counters: dict[str, float]) -> dict[str, float]:
    """What a step's metrics row adds to the trainer's figures ``m``: the version it ends on,
    its wait for the batch and its whole time (``step_s``: from the previous step's end, so a
    snapshot copy or checkpoint stall counts), throughput over that time (``samples``
    completions), the buffer's size and counters, the producers' figures (the control
    channel's) and the learner's counters."""
    bs = buffer_stats
    return {
        "version": float(version), "wait_s": wait_s, "step_s": step_s,
        "tokens_per_s": m["trained_tokens"] / max(step_s, 1e-9),
        "samples_per_s": samples / max(step_s, 1e-9),
        "buffer_size": float(buffer_size), "dropped_stale": float(bs.dropped_stale),
        "rejected_frames": float(bs.rejected), "received": float(bs.received),
        "rejected_groups": float(sum(bs.rejected_groups.values())),
        **{f"rejected_groups/{k}": float(v) for k, v in bs.rejected_groups.items()},
        **producers,
        **{k: float(v) for k, v in counters.items()},
    }
