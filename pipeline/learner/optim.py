"""The learner's AdamW, its two moments in fp32 or in bf16 (``train.optimizer_state``).

Why bf16 moments: a full fine-tune holds 16 bytes a parameter (fp32 weights, gradients and two
moments); bf16 moments hold 12, which is what lets a 3B policy train beside its engine on one
80 GB card (``pipeline.memory_plan``). The master weights and the update stay fp32: each
parameter's moments are widened to fp32, updated, applied and narrowed back in slices of
``SLICE`` elements, so the fp32 temporaries never exceed a few slices whatever the parameter's
size (a 151k x 2048 embedding would otherwise need 3.7 GB of them).

Invariants: the same update as ``torch.optim.AdamW`` (decoupled weight decay, bias correction)
up to the moments' bf16 rounding; its ``state_dict`` is a torch optimiser's, so checkpoints
save and load it as they do AdamW's.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SLICE = 1 << 24  # elements per fp32 working slice (64 MB per temporary)


class AdamWBf16Moments(torch.optim.Optimizer):
    """AdamW whose ``exp_avg`` and ``exp_avg_sq`` are stored in bf16."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], \
                group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                state["step"] += 1
                t = float(state["step"])
                step_size = lr / (1 - b1 ** t)
                root_bc2 = math.sqrt(1 - b2 ** t)
                w, g = p.view(-1), p.grad.view(-1)
                m16, v16 = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
                for s in range(0, w.numel(), SLICE):
                    e = s + SLICE
                    gs = g[s:e].float()
                    m = m16[s:e].float().mul_(b1).add_(gs, alpha=1 - b1)
                    v = v16[s:e].float().mul_(b2).addcmul_(gs, gs, value=1 - b2)
                    if wd:
                        w[s:e].mul_(1 - lr * wd)
                    w[s:e].addcdiv_(m, v.sqrt().div_(root_bc2).add_(eps), value=-step_size)
                    m16[s:e].copy_(m)
                    v16[s:e].copy_(v)
        return loss


def make_adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float,
               state: str, fused: bool) -> torch.optim.Optimizer:
    """AdamW over ``params``: torch's (fused on a GPU) with fp32 moments, or ours with bf16
    moments when ``state`` is 'bf16' ('auto' here means the plan did not run: fp32)."""
    if state == "bf16":
        return AdamWBf16Moments(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)
