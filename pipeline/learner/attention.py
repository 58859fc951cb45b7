"""Variable-length attention for packed micro-batches (``train.packing``).

A packed micro-batch is one row holding several sequences back to back. The attention must
stay inside each sequence: with SDPA that takes a dense (tokens x tokens) block-diagonal mask,
whose cost grows with the square of the whole row (measured at 3B on an H200: a 37k-token row
ran 4x slower than padded rows). Torch's own varlen flash attention
(``torch.nn.attention.varlen.varlen_attn``) reads the sequence boundaries from cumulative
lengths instead and costs what the sequences cost alone.

``VARLEN`` is registered under transformers' ``AttentionInterface`` (a named entry, idempotent)
and chosen per model with ``attn_implementation=VARLEN``; transformers builds no mask for it. The
forward passes the boundaries as the keyword arguments transformers' flash-attention path uses
(``cu_seq_lens_q/k``, ``max_length_q/k``: ``varlen_kwargs``), and they reach every attention
layer. Without them (an unpacked call) the layer runs SDPA, causal. Off CUDA each sequence runs
SDPA on its own (the same maths; CPU tests).
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import torch

VARLEN = "pipeline_varlen"


def varlen_available() -> bool:
    """Torch has the varlen flash-attention op (torch >= 2.10) and a CUDA device to run it."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def varlen_kwargs(position_ids: torch.Tensor) -> dict[str, Any]:
    """Cumulative sequence lengths of a packed row, read off its position ids (0 starts one)."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).reshape(-1)
    cu = torch.cat([starts, torch.tensor([pos.numel()], device=pos.device)]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest,
            "max_length_k": longest}


def per_sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                           scale: float | None) -> torch.Tensor:
    """(tokens, heads, dim) in, the same out: causal SDPA over each sequence alone."""
    rep = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    bounds = cu.tolist()
    for s, e in itertools.pairwise(bounds):
        qi, ki, vi = (t[s:e].transpose(0, 1) for t in (q, k, v))
        if rep > 1:
            ki, vi = ki.repeat_interleave(rep, 0), vi.repeat_interleave(rep, 0)
        out[s:e] = torch.nn.functional.scaled_dot_product_attention(
            qi, ki, vi, is_causal=True, scale=scale).transpose(0, 1)
    return out


def flash_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                           longest: int, scale: float | None) -> torch.Tensor:
    """(tokens, heads, dim) in, the same out: torch's varlen flash attention over the sequences
    that ``cu`` bounds (``longest``: the longest), causal, adapted to the op's signature (GQA,
    causal window, scale) of the installed torch."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kw: dict[str, Any] = {}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if "window_size" in params:
        kw["window_size"] = (-1, 0)  # causal
    else:
        kw["is_causal"] = True
    if "scale" in params:
        kw["scale"] = scale
    elif scale is not None:  # the op's own scale is 1/sqrt(head_dim): fold ours into q
        q = q * (scale * q.shape[-1] ** 0.5)
    return varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, longest, longest,
                       **kw)


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0, **kwargs: Any
                     ) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (batch, heads, tokens, dim) in, (batch,
    tokens, heads, dim) out."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, is_causal=True)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if q.is_cuda and q.dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
        # Rotary embeddings leave q/k in fp32 under autocast; SDPA would be cast by autocast,
        # this op is not on its list: cast as it would.
        low = torch.get_autocast_dtype("cuda")
        q, k, v = q.to(low), k.to(low), v.to(low)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        out = flash_varlen_attention(q, k, v, cu.to(q.device, torch.int32),
                                     int(kwargs["max_length_q"]), scaling)
    else:  # the flash kernels have no fp32: each sequence through SDPA
        out = per_sequence_attention(q, k, v, cu, scaling)
    return out[None], None


def register() -> str:
    """Make ``VARLEN`` a valid ``attn_implementation``; returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention)
    return VARLEN
