"""From rollout groups to the learner's micro-batches: flattening, token-budget planning, and the
two tensor layouts a micro-batch can take.

Pure data logic (numpy/torch tensors on the CPU, no model). A micro-batch has two sides:
- the model side, what the forward pass reads: right-padded rows (``collate``) or every sequence
  of the micro-batch concatenated into one row with per-sequence position ids and no pad token
  (``collate_packed``); ``select`` marks the positions whose next token is a loss token;
- the loss side, on a completion grid (n rows x longest completion of the micro-batch) that is
  the same for both layouts: ``mask`` (loss tokens), ``behaviour`` logprobs, ``advantages``.
The selected model positions, read row by row, are the grid's mask positions in row-major order,
so ``grid.masked_scatter(mask, flat_logprobs)`` carries the forward's result to the loss, and the
loss (its value, gradient and metrics) cannot depend on the layout.

Loss tokens are the sampled completion tokens with a finite behaviour logprob: tool/environment
tokens of an episode (``masked_spans``) are context, never targets, and never counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from buffer.schema import RolloutGroup
from pipeline.learner.loss import group_advantages


@dataclass
class PackedBatch:
    """Completions of a batch, flattened (one row per completion), before any layout."""

    sequences: list[np.ndarray]     # prompt + completion token ids
    prompt_lens: list[int]
    behaviour: list[np.ndarray]     # completion tokens' behaviour logprobs (NaN: not in the loss)
    versions: list[np.ndarray]      # per-token policy version of the completion tokens
    advantages: torch.Tensor        # (n_completions,)
    rewards: torch.Tensor           # (n_groups, G)
    # Per completion token: (temperature, top_p, top_k) it was drawn with; None for a row drawn
    # untempered and untruncated (the learner then computes plain log-softmax, at no cost).
    sampling: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None] | None = None

    def loss_tokens(self, i: int) -> int:
        """Sampled completion tokens of row ``i`` that the loss counts."""
        return int(np.isfinite(self.behaviour[i]).sum())

    def lengths(self) -> list[int]:
        return [len(s) for s in self.sequences]


def pack_groups(groups: list[RolloutGroup], scale_rewards: bool, std_eps: float) -> PackedBatch:
    sizes = {len(g.completions) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"groups of different sizes in one batch: {sorted(sizes)}")
    rewards = torch.tensor([[c.reward for c in g.completions] for g in groups],
                           dtype=torch.float32)
    adv = group_advantages(rewards, scale=scale_rewards, eps=std_eps).reshape(-1)
    seqs, plens, beh, vers = [], [], [], []
    sampling: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None] = []
    for g in groups:
        for c in g.completions:
            seqs.append(np.concatenate([g.prompt_token_ids, c.token_ids]).astype(np.int64))
            plens.append(len(g.prompt_token_ids))
            # Tool/environment tokens of an episode (masked_spans): NaN behaviour logprobs
            # keep them out of the loss mask (collate), as context only.
            beh.append(np.where(c.loss_mask(), c.logprobs, np.nan).astype(np.float32)
                       if c.masked_spans else c.logprobs)
            vers.append(c.per_token_versions())
            sampling.append(c.per_token_sampling() if c.sampling_segments else None)
    return PackedBatch(seqs, plens, beh, vers, adv, rewards,
                       sampling if any(x is not None for x in sampling) else None)


def plan_micro_batches(lengths: list[int], rows: list[int], max_rows: int, max_tokens: int,
                       packed: bool) -> list[list[int]]:
    """Split ``rows`` into micro-batches.

    ``max_tokens`` = 0: consecutive runs of ``max_rows`` rows (the row-count plan). Otherwise a
    token budget: first-fit over the rows by decreasing length, where a micro-batch costs the sum
    of its lengths when ``packed`` and rows x its longest length when padded; a row longer than
    the budget goes alone. Each micro-batch keeps its rows in ascending order; deterministic, so
    every rank can compute every other rank's plan (DeepSpeed needs the largest count).
    """
    if not rows:
        return []
    if max_tokens <= 0:
        return [rows[i: i + max_rows] for i in range(0, len(rows), max_rows)]
    bins: list[list[int]] = []
    cost: list[tuple[int, int]] = []  # (sum of lengths, longest) per bin
    for r in sorted(rows, key=lambda r: (-lengths[r], r)):
        n = lengths[r]
        for b, (total, longest) in enumerate(cost):
            new = total + n if packed else (len(bins[b]) + 1) * max(longest, n)
            if new <= max_tokens:
                bins[b].append(r)
                cost[b] = (total + n, max(longest, n))
                break
        else:
            bins.append([r])
            cost.append((n, n))
    return [sorted(b) for b in bins]


def _grid(pb: PackedBatch, rows: list[int]) -> dict[str, torch.Tensor]:
    """Loss side of a micro-batch: (n, T) completion grid, T its longest completion."""
    lens = [len(pb.sequences[i]) - pb.prompt_lens[i] for i in rows]
    T = max(max(lens), 1)
    mask = torch.zeros((len(rows), T), dtype=torch.bool)
    behaviour = torch.zeros((len(rows), T), dtype=torch.float32)
    for r, (i, t) in enumerate(zip(rows, lens, strict=True)):
        if t:
            lp = torch.from_numpy(np.asarray(pb.behaviour[i], dtype=np.float32))
            behaviour[r, :t] = torch.nan_to_num(lp, nan=0.0, posinf=0.0, neginf=0.0)
            mask[r, :t] = torch.isfinite(lp)
    grid = {"mask": mask, "behaviour": behaviour, "advantages": pb.advantages[rows]}
    if pb.sampling is not None and any(pb.sampling[i] is not None for i in rows):
        grid |= _sampling_grid(pb, rows, T)
    return grid


def _sampling_grid(pb: PackedBatch, rows: list[int], T: int) -> dict[str, torch.Tensor]:
    """Each loss token's (temperature, top_p, top_k) on the grid: ``temperature`` always,
    ``top_p`` and ``top_k`` only when a token of the micro-batch was drawn truncated (their
    sort over the vocabulary is the one cost of replaying a truncation)."""
    temp = torch.ones((len(rows), T), dtype=torch.float32)
    top_p = torch.ones((len(rows), T), dtype=torch.float32)
    top_k = torch.zeros((len(rows), T), dtype=torch.int64)
    assert pb.sampling is not None
    for r, i in enumerate(rows):
        if pb.sampling[i] is not None:
            t, p, k = pb.sampling[i]
            temp[r, :len(t)] = torch.from_numpy(t)
            top_p[r, :len(p)] = torch.from_numpy(p)
            top_k[r, :len(k)] = torch.from_numpy(k.astype(np.int64))
    out = {"temperature": temp}
    if bool((top_p < 1).any()) or bool((top_k > 0).any()):
        out |= {"top_p": top_p, "top_k": top_k}
    return out


def collate(pb: PackedBatch, rows: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded model side for ``rows`` (``select`` aligned with positions [:, :-1]) and the
    loss-side grid."""
    L = max(len(pb.sequences[i]) for i in rows)
    n = len(rows)
    ids = torch.full((n, L), pad_id, dtype=torch.long)
    attn = torch.zeros((n, L), dtype=torch.long)
    select = torch.zeros((n, L - 1), dtype=torch.bool)
    for r, i in enumerate(rows):
        seq = pb.sequences[i]
        ids[r, : len(seq)] = torch.from_numpy(seq)
        attn[r, : len(seq)] = 1
        p, t = pb.prompt_lens[i], len(seq) - pb.prompt_lens[i]
        if t:
            # Token at position p + k is predicted by the hidden state at p + k - 1.
            select[r, p - 1: p - 1 + t] = torch.from_numpy(np.isfinite(pb.behaviour[i]))
    return {"input_ids": ids, "attention_mask": attn, "select": select, **_grid(pb, rows)}


def collate_packed(pb: PackedBatch, rows: list[int]) -> dict[str, torch.Tensor]:
    """Every sequence of ``rows`` in one row, no padding: position ids restart at 0 for each
    sequence, which transformers' attention (flash-attention varlen, or SDPA/eager through a
    block-diagonal causal mask) reads as sequence boundaries when no attention mask is given.
    ``select`` is never set on a sequence's last position, so no target crosses a boundary."""
    seqs = [pb.sequences[i] for i in rows]
    ids = torch.from_numpy(np.concatenate(seqs))[None]
    pos = torch.from_numpy(np.concatenate([np.arange(len(s)) for s in seqs]))[None]
    select = torch.zeros((1, ids.shape[1] - 1), dtype=torch.bool)
    start = 0
    for i, seq in zip(rows, seqs, strict=True):
        p, t = pb.prompt_lens[i], len(seq) - pb.prompt_lens[i]
        if t:
            select[0, start + p - 1: start + p - 1 + t] = torch.from_numpy(
                np.isfinite(pb.behaviour[i]))
        start += len(seq)
    return {"input_ids": ids, "position_ids": pos, "select": select, **_grid(pb, rows)}
