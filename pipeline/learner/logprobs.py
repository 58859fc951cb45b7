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
- Every logprob (the policy's, the reference's) is of the distribution the engine sampled the
  token from: logits / its temperature, cut to its top-k and top-p (``truncate``); a batch
  drawn at temperature 1 with no truncation takes the plain path, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.learner.attention import varlen_kwargs
from pipeline.learner.batching import PackedBatch, collate, collate_packed

MODEL_KEYS = ("input_ids", "select", "attention_mask", "position_ids")  # the forward's inputs


SAMPLING_KEYS = ("temperature", "top_p", "top_k")  # per loss token, on the grid (batching)


def truncate(logits: torch.Tensor, targets: torch.Tensor, top_p: torch.Tensor,
             top_k: torch.Tensor) -> torch.Tensor:
    """``logits`` with every token outside each row's top-k, then its top-p, set to -inf
    (vLLM's sampler rule: ties at the k-th value kept, the nucleus the smallest set whose mass
    reaches top_p, at least one token); ``top_k`` 0 and ``top_p`` 1 leave a row whole.

    The target (the sampled token) is always kept: where the engine's and the learner's
    numbers put it on opposite sides of the cut, its logprob stays finite and close to the
    engine's instead of -inf. The kept set is a constant of the logits (no gradient flows
    through the cut), as it is for the sampler."""
    with torch.no_grad():
        ranked, order = logits.sort(dim=-1)  # ascending
        V = logits.shape[-1]
        k = torch.where(top_k > 0, top_k.clamp(max=V), V).to(torch.long)
        kth = ranked.gather(1, (V - k).unsqueeze(1))
        drop = ranked < kth
        ranked = ranked.masked_fill(drop, float("-inf"))
        mass = ranked.softmax(dim=-1).cumsum(dim=-1)
        drop |= mass <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False
        drop = torch.zeros_like(drop).scatter_(1, order, drop)
        drop.scatter_(1, targets.unsqueeze(1), False)
    return logits.masked_fill(drop, float("-inf"))


def _head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                   *sampling: torch.Tensor) -> torch.Tensor:
    """log pi(target) from hidden states: the output projection and a fused log-softmax +
    gather (cross-entropy), in fp32 over the vocabulary. ``sampling``: nothing (temperature
    1, no truncation), each token's temperature, or temperature, top_p and top_k, so pi is the
    distribution the engine drew the token from (``pipeline.producer.trained_sampling``)."""
    logits = head(hidden).float()
    if sampling:
        logits = logits / sampling[0].unsqueeze(1)
    if len(sampling) == 3:
        logits = truncate(logits, targets, sampling[1], sampling[2])
    return -torch.nn.functional.cross_entropy(logits, targets, reduction="none")


def selected_logprobs(model: Any, input_ids: torch.Tensor, select: torch.Tensor,
                      attention_mask: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None, chunk: int = 0,
                      sampling: tuple[torch.Tensor, ...] = (), **attention: Any
                      ) -> torch.Tensor:
    """log pi(x_t | x_<t) of the tokens whose predicting position ``select`` marks (``select`` is
    aligned with positions [:, :-1]); a flat (K,) tensor, row by row.

    The output projection and softmax run only on the selected positions: with a large
    vocabulary they dominate the cost, and prompt positions carry no loss. With ``chunk`` > 0 they
    run ``chunk`` positions at a time, each chunk recomputed in the backward pass
    (``torch.utils.checkpoint``), so the fp32 logits of at most one chunk exist at once instead
    of K x vocabulary of them. ``sampling``: each selected token's temperature (and top_p,
    top_k), flat (K,) like the result (``_head_logprobs``); fp32 values may come as their int32
    bits (``micro_batch_logprobs``). ``attention``: keyword arguments for the attention
    layers (a packed row's sequence boundaries, ``pipeline.learner.attention.varlen_kwargs``).
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
    sampling = tuple(x.view(torch.float32) if x.dtype == torch.int32 else x for x in sampling)
    head = model.get_output_embeddings()
    if chunk <= 0 or len(h) <= chunk:
        return _head_logprobs(head, h, targets, *sampling)
    from torch.utils.checkpoint import checkpoint

    return torch.cat([checkpoint(_head_logprobs, head, h[i: i + chunk], targets[i: i + chunk],
                                 *(x[i: i + chunk] for x in sampling), use_reentrant=False)
                      for i in range(0, len(h), chunk)])


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

    def forward(self, input_ids, select, attention_mask=None, position_ids=None, sampling=(),
                **attention):
        return selected_logprobs(self.model, input_ids, select, attention_mask, position_ids,
                                 self.chunk, sampling, **attention)


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
    # The distribution each token was drawn from, flat in the selected positions' order, as
    # the bits of its fp32 values: a mixed-precision wrapper (FSDP2's) casts floating inputs of
    # the forward to bf16, which would turn a temperature of 0.7 into 0.6992.
    sampling = tuple(b[k][b["mask"]].view(torch.int32) if b[k].is_floating_point()
                     else b[k][b["mask"]] for k in SAMPLING_KEYS if k in b)
    if sampling:
        model_in["sampling"] = sampling
    lp = on_grid(policy(**model_in), b["mask"])
    ref = None
    if ref_model is not None:
        with torch.no_grad():
            ref = on_grid(ref_model(**model_in), b["mask"])
    return lp, ref
