"""The model's per-token log-probabilities of a micro-batch: the forward pass, the output head in
vocabulary chunks, and the flat result placed on the loss-side grid.

Owns the hand-off from a micro-batch's two layouts (``pipeline.learner.batching``) to the loss:
the micro-batch on the device with the attention's keyword arguments (``device_batch``), the
forward behind one ``torch.nn.Module`` (``Policy``, so DDP and DeepSpeed hook their gradient
reduction into it), and ``micro_batch_logprobs``, the policy's and the frozen reference's
logprobs on the grid that ``grpo_loss`` reads.

Invariants:
- The output projection and softmax run only on the positions ``select`` marks, in fp32; with a
  chunk size they run that many positions at a time, each chunk recomputed in the backward
  pass, and give the same numbers as the whole.
- The selected positions, read row by row, are the grid's mask positions in row-major order
  (``batching``), so ``on_grid`` needs no index and both layouts give the same grid.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.learner.attention import varlen_kwargs
from pipeline.learner.batching import PackedBatch, collate, collate_packed

MODEL_KEYS = ("input_ids", "select", "attention_mask", "position_ids")  # the forward's inputs


def _head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor
                   ) -> torch.Tensor:
    """log pi(target) from hidden states: the output projection and a fused log-softmax +
    gather (cross-entropy), in fp32 over the vocabulary."""
    return -torch.nn.functional.cross_entropy(head(hidden).float(), targets, reduction="none")


def selected_logprobs(model: Any, input_ids: torch.Tensor, select: torch.Tensor,
                      attention_mask: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None, chunk: int = 0,
                      **attention: Any) -> torch.Tensor:
    """log pi(x_t | x_<t) of the tokens whose predicting position ``select`` marks (``select`` is
    aligned with positions [:, :-1]); a flat (K,) tensor, row by row.

    The output projection and softmax run only on the selected positions: with a large
    vocabulary they dominate the cost, and prompt positions carry no loss. With ``chunk`` > 0 they
    run ``chunk`` positions at a time, each chunk recomputed in the backward pass
    (``torch.utils.checkpoint``), so the fp32 logits of at most one chunk exist at once instead
    of K x vocabulary of them. ``attention``: keyword arguments for the attention layers (a
    packed row's sequence boundaries, ``pipeline.learner.attention.varlen_kwargs``).
    """
    if hasattr(model, "get_base_model"):  # peft: the HF model with LoRA layers injected
        model = model.get_base_model()
    # No KV cache: it is never read in training, and with one transformers only reads packed
    # sequences' boundaries from the position ids when there is none.
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids, use_cache=False, **attention
                              ).last_hidden_state[:, :-1]
    h = hidden[select]
    targets = input_ids[:, 1:][select]
    head = model.get_output_embeddings()
    if chunk <= 0 or len(h) <= chunk:
        return _head_logprobs(head, h, targets)
    from torch.utils.checkpoint import checkpoint

    return torch.cat([checkpoint(_head_logprobs, head, h[i: i + chunk], targets[i: i + chunk],
                                 use_reentrant=False) for i in range(0, len(h), chunk)])


def on_grid(flat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Flat logprobs of the selected positions onto the loss-side grid (``batching``)."""
    out = torch.zeros(mask.shape, dtype=flat.dtype, device=flat.device)
    return out.masked_scatter(mask, flat)


def token_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   mask: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """log pi(x_t | x_<t) for t >= 1, shape (B, L-1); 0 where ``mask`` is False."""
    return on_grid(selected_logprobs(model, input_ids, mask, attention_mask=attention_mask,
                                     chunk=chunk), mask)


class Policy(torch.nn.Module):
    """The model behind one ``forward`` that returns token logprobs: DDP and DeepSpeed hook
    their gradient reduction into the wrapped module's forward, so it must be called, not
    ``model.base_model`` directly. Its state dict holds the model's under ``model.``."""

    def __init__(self, model: torch.nn.Module, chunk: int = 0):
        super().__init__()
        self.model = model
        self.chunk = chunk

    def forward(self, input_ids, select, attention_mask=None, position_ids=None, **attention):
        return selected_logprobs(self.model, input_ids, select, attention_mask, position_ids,
                                 self.chunk, **attention)


def device_batch(pb: PackedBatch, rows: list[int], packing: bool, pad_id: int,
                 device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The micro-batch ``rows`` on the device (padded rows, or one packed row), and the model's
    keyword arguments (a packed row's sequence boundaries, computed here on the host so the
    forward never waits for them)."""
    if not packing:
        b = collate(pb, rows, pad_id)
        return {k: v.to(device, non_blocking=True) for k, v in b.items()}, {}
    b = collate_packed(pb, rows)
    bounds = varlen_kwargs(b["position_ids"])
    bounds = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v
              for k, v in bounds.items()}
    return {k: v.to(device, non_blocking=True) for k, v in b.items()}, bounds


def micro_batch_logprobs(policy: Any, ref_model: Any | None, b: dict[str, torch.Tensor],
                         attention: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The policy's logprobs (with grad) and the frozen reference's (None without one) of a
    ``device_batch``, on its loss-side grid."""
    model_in = {k: b[k] for k in MODEL_KEYS if k in b} | attention
    lp = on_grid(policy(**model_in), b["mask"])
    ref = None
    if ref_model is not None:
        with torch.no_grad():
            ref = on_grid(ref_model(**model_in), b["mask"])
    return lp, ref
