"""The policy and its optimiser: turns a batch of rollout groups into one GRPO optimiser step.

Synchronous torch code only (the learner runs it in a worker thread so that its event loop keeps
receiving groups). Owns: model loading, batch packing, micro-batched forward/backward with the
loss from ``pipeline.loss``, the non-finite-step guard, and the weights that go into snapshots.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from buffer.schema import RolloutGroup
from pipeline.config import RunConfig
from pipeline.loss import group_advantages, grpo_loss


@dataclass
class PackedBatch:
    """Completions of a batch, flattened (one row per completion), before padding."""

    sequences: list[np.ndarray]     # prompt + completion token ids
    prompt_lens: list[int]
    behaviour: list[np.ndarray]     # behaviour logprobs of the completion tokens
    versions: list[np.ndarray]      # per-token policy version of the completion tokens
    advantages: torch.Tensor        # (n_completions,)
    rewards: torch.Tensor           # (n_groups, G)


def pack_groups(groups: list[RolloutGroup], scale_rewards: bool, std_eps: float) -> PackedBatch:
    sizes = {len(g.completions) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"groups of different sizes in one batch: {sorted(sizes)}")
    rewards = torch.tensor([[c.reward for c in g.completions] for g in groups],
                           dtype=torch.float32)
    adv = group_advantages(rewards, scale=scale_rewards, eps=std_eps).reshape(-1)
    seqs, plens, beh, vers = [], [], [], []
    for g in groups:
        for c in g.completions:
            seqs.append(np.concatenate([g.prompt_token_ids, c.token_ids]).astype(np.int64))
            plens.append(len(g.prompt_token_ids))
            beh.append(c.logprobs)
            vers.append(c.per_token_versions())
    return PackedBatch(seqs, plens, beh, vers, adv, rewards)


def collate(pb: PackedBatch, rows: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors for ``rows``; targets/masks are aligned with logits[:, :-1]."""
    L = max(len(pb.sequences[i]) for i in rows)
    n = len(rows)
    ids = torch.full((n, L), pad_id, dtype=torch.long)
    attn = torch.zeros((n, L), dtype=torch.long)
    mask = torch.zeros((n, L - 1), dtype=torch.bool)
    behaviour = torch.zeros((n, L - 1), dtype=torch.float32)
    for r, i in enumerate(rows):
        seq = pb.sequences[i]
        ids[r, : len(seq)] = torch.from_numpy(seq)
        attn[r, : len(seq)] = 1
        p, t = pb.prompt_lens[i], len(seq) - pb.prompt_lens[i]
        if t:
            lp = torch.from_numpy(np.asarray(pb.behaviour[i], dtype=np.float32))
            # Token at position p + k is predicted by logits at p + k - 1.
            behaviour[r, p - 1: p - 1 + t] = lp
            mask[r, p - 1: p - 1 + t] = torch.isfinite(lp)
    return {"input_ids": ids, "attention_mask": attn, "mask": mask, "behaviour": behaviour,
            "advantages": pb.advantages[rows]}


def token_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
    """log pi(x_t | x_<t) for t >= 1, shape (B, L-1); 0 where ``mask`` is False.

    The output projection and softmax run only on the masked (completion) positions: with a
    large vocabulary they dominate the cost, and prompt positions carry no loss.
    """
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask
                              ).last_hidden_state[:, :-1]
    logits = model.get_output_embeddings()(hidden[mask]).float()
    picked = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:][mask][:, None])
    out = torch.zeros(mask.shape, dtype=picked.dtype, device=picked.device)
    return out.masked_scatter(mask, picked.squeeze(-1))


class PolicyTrainer:
    def __init__(self, cfg: RunConfig, model_path: str, device: str | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        torch.manual_seed(cfg.train.seed)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # fp32 master weights; bf16 autocast on GPUs (CPU autocast is slower than fp32 here).
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.to(self.device).train()
        if cfg.train.freeze_layers:
            self._freeze(cfg.train.freeze_layers)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        t = cfg.train
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=t.lr,
                                           weight_decay=t.weight_decay)
        warm = max(t.warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        self.ref_model = None
        if t.loss.kl_coef > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            self.ref_model.to(self.device).eval().requires_grad_(False)
        self.snapshot_dtype = getattr(torch, cfg.model.dtype)
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        self._skip = {"lm_head.weight"} if tied else set()

    def _freeze(self, k: int) -> None:
        layers = self.model.base_model.layers
        if k > len(layers):
            raise ValueError(f"train.freeze_layers={k} but the model has {len(layers)} layers")
        self.model.get_input_embeddings().requires_grad_(False)
        for layer in layers[:k]:
            layer.requires_grad_(False)

    def _autocast(self):
        """bf16 autocast where the hardware has bf16 math (GPUs, AVX512-BF16/AMX CPUs: ~5x
        faster matmuls than fp32 on the 2-core dev machines); fp32 master weights either way."""
        if self.cfg.model.dtype != "bfloat16":
            return torch.autocast(self.device.type, enabled=False)
        if self.device.type == "cpu" and not torch.cpu._is_avx512_bf16_supported():
            return torch.autocast("cpu", enabled=False)
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def step(self, groups: list[RolloutGroup], learner_version: int) -> dict[str, float]:
        """One optimiser step on ``groups``; returns metrics. A non-finite loss or gradient
        skips the update (``skipped_nonfinite`` = 1) so bad weights never reach producers."""
        t0 = time.perf_counter()
        lc = self.cfg.train.loss
        pb = pack_groups(groups, lc.scale_rewards, lc.std_eps)
        n = len(pb.sequences)
        mb = self.cfg.train.micro_batch
        total_tokens = sum(len(s) - p for s, p in zip(pb.sequences, pb.prompt_lens,
                                                       strict=True))
        normalizer = float(max(total_tokens, 1))
        self.optimizer.zero_grad(set_to_none=True)
        acc: dict[str, float] = {}
        finite = True
        for start in range(0, n, mb):
            rows = list(range(start, min(start + mb, n)))
            b = {k: v.to(self.device) for k, v in collate(pb, rows, self.pad_id).items()}
            with self._autocast():
                lp = token_logprobs(self.model, b["input_ids"], b["attention_mask"], b["mask"])
                ref = None
                if self.ref_model is not None:
                    with torch.no_grad():
                        ref = token_logprobs(self.ref_model, b["input_ids"],
                                             b["attention_mask"], b["mask"])
            out = grpo_loss(lp, b["behaviour"], b["advantages"], b["mask"].float(), lc,
                            ref_logprobs=ref,
                            normalizer=normalizer if lc.agg == "token_mean" else None)
            loss = out.loss if lc.agg == "token_mean" else out.loss * len(rows) / n
            if not torch.isfinite(loss):
                finite = False
                break
            loss.backward()
            weight = b["mask"].sum().item() / normalizer
            for k, v in out.metrics.items():
                acc[k] = acc.get(k, 0.0) + float(v) * (1.0 if k == "loss" else weight)
        grad_norm = math.nan
        if finite:
            clip = self.cfg.train.grad_clip
            grad_norm = float(torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), clip if clip > 0 else float("inf")))
            finite = math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        vers = np.concatenate([v for v in pb.versions if len(v)]) if total_tokens else \
            np.zeros(0)
        stale = [learner_version - g.policy_version for g in groups]
        metrics = {f"loss/{k}": v for k, v in acc.items()}
        metrics.update({
            "reward_mean": float(pb.rewards.mean()),
            "reward_std": float(pb.rewards.std()) if pb.rewards.numel() > 1 else 0.0,
            "degenerate_frac": float((pb.rewards.amax(1) == pb.rewards.amin(1)).float().mean()),
            "completion_len_mean": total_tokens / max(n, 1),
            "trained_tokens": float(total_tokens),
            "staleness_mean": float(np.mean(stale)),
            "staleness_max": float(np.max(stale)),
            "token_staleness_mean": float(np.mean(learner_version - vers)) if len(vers) else 0.0,
            "grad_norm": grad_norm,
            "lr": self.scheduler.get_last_lr()[0],
            "skipped_nonfinite": 0.0 if finite else 1.0,
            "train_s": time.perf_counter() - t0,
        })
        for s in stale:
            metrics[f"staleness_hist/{s}"] = metrics.get(f"staleness_hist/{s}", 0.0) + 1
        keys = {k for g in groups for c in g.completions for k in c.reward_breakdown}
        for k in sorted(keys):
            vals = [c.reward_breakdown.get(k, 0.0) for g in groups for c in g.completions]
            metrics[f"reward/{k}"] = float(np.mean(vals))
        return metrics

    def snapshot_tensors(self) -> dict[str, torch.Tensor]:
        """Weights for producers, in the engines' dtype, HF names (tied lm_head left out).

        Only trainable tensors travel: frozen ones never change, so engines keep theirs.
        """
        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        return {k: v.detach().to(self.snapshot_dtype) for k, v in self.model.state_dict().items()
                if k not in self._skip and k in trainable}

    # -------------------------------------------------------------- checkpoint state
    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": torch.get_rng_state()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])


def save_pretrained(trainer: PolicyTrainer, out: Path) -> None:
    trainer.model.save_pretrained(out)
    trainer.tokenizer.save_pretrained(out)
