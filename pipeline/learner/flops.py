"""Model FLOPs of a learner step and the device's peak, for the per-step MFU metric.

MFU = model FLOPs of the step / (seconds x peak bf16 FLOP/s x ranks). Model FLOPs count what the
step must compute, not what it recomputes (gradient checkpointing and chunked logprobs add work
that MFU does not credit), and for a forward plus backward pass are 3x the forward:
- every token of every sequence goes through the decoder's matmuls: 6 x N_body per token, where
  N_body counts the attention projections (grouped-query: fewer K/V heads) and the gated MLP of
  every layer (embeddings are a lookup, norms and biases are negligible);
- only positions that predict a loss token go through the output projection (the learner skips
  the others): 6 x hidden x vocab per such position;
- causal attention: a sequence of S tokens costs 2 x 2 x d_attn x S(S+1)/2 per layer forward
  (scores and the weighted sum over the earlier positions), so 6 x d_attn x S(S+1) per layer.
Frozen layers (``train.freeze_layers``) still count their full backward: an upper-bound model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Dense bf16 tensor-core peak (no sparsity), by a substring of torch.cuda.get_device_name(),
# the first match wins (more specific names first). H200 has the H100 SXM's compute.
PEAK_BF16 = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A6000", 155e12),
    ("A10G", 70e12),
    ("L4", 121e12),
)


def peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of a GPU named ``device_name``; None if unknown (no MFU then)."""
    for key, peak in PEAK_BF16:
        if key in device_name:
            return peak
    return None


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers config (Llama/Qwen/Mistral-style decoder names)."""
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        return cls(hidden=hidden, layers=int(config.num_hidden_layers), heads=heads,
                   kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                   head_dim=int(head_dim), intermediate=int(config.intermediate_size),
                   vocab=int(config.vocab_size))

    @property
    def body_params(self) -> int:
        """Matmul parameters of the decoder layers (no embeddings, no output projection)."""
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (q + kv + o + mlp)


def train_flops(shape: ModelShape, seq_lens: list[int], head_positions: int) -> float:
    """Forward + backward model FLOPs of one pass over sequences of ``seq_lens`` tokens, with
    ``head_positions`` positions going through the output projection."""
    tokens = sum(seq_lens)
    d_attn = shape.heads * shape.head_dim
    attention = 6 * shape.layers * d_attn * sum(s * (s + 1) for s in seq_lens)
    return float(6 * shape.body_params * tokens + 6 * shape.hidden * shape.vocab * head_positions
                 + attention)
