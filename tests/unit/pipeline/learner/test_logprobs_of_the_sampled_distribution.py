"""The learner's logprobs of the distribution each token was drawn from: logits / temperature,
cut to top-k then top-p (``pipeline.learner.logprobs``), against an independent numpy
recomputation; on the grid of both layouts, chunked or not, and through a wrapper that casts
floating inputs to bf16 as FSDP2's mixed precision does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from buffer.schema import Completion, RolloutGroup
from pipeline.learner.batching import pack_groups
from pipeline.learner.logprobs import Policy, device_batch, micro_batch_logprobs, truncate
from tests.sampling_reference import sampled_logprob

V = 96


def test_truncate_matches_the_sampler_rule():
    gen = torch.Generator().manual_seed(0)
    n = 64
    logits = torch.randn(n, V, generator=gen, dtype=torch.float64) * 3
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.95] * (n // 4), dtype=torch.float64)
    top_k = torch.tensor([0, 0, 20, 5] * (n // 4))
    temp = torch.tensor([0.5, 0.7, 1.0, 1.5] * (n // 4), dtype=torch.float64)
    # Targets drawn from the whole vocabulary: some fall outside the kept set.
    targets = torch.randint(0, V, (n,), generator=gen)
    lp = torch.log_softmax(truncate(logits / temp[:, None], targets, top_p, top_k), -1)
    got = lp.gather(1, targets[:, None]).squeeze(1)
    want = [sampled_logprob(logits[i].numpy(), int(targets[i]), float(temp[i]), float(top_p[i]),
                       int(top_k[i])) for i in range(n)]
    np.testing.assert_allclose(got.numpy(), want, atol=1e-10)
    # Untruncated rows are the plain tempered log-softmax; truncated ones renormalise above it.
    plain = torch.log_softmax(logits / temp[:, None], -1).gather(1, targets[:, None]).squeeze(1)
    assert torch.equal(got[0::4], plain[0::4])
    assert (got[1::4] > plain[1::4]).all() and (got[2::4] > plain[2::4]).all()


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def _groups() -> list[RolloutGroup]:
    rng = np.random.default_rng(1)
    sampling = [[(0, 0.5, 1.0, 0)], [], [(0, 0.7, 0.9, 0), (4, 1.5, 1.0, 20)], [(2, 1.3, 1.0, 5)]]
    groups = []
    for gi in range(2):
        comps = []
        for ci in range(2):
            n = int(rng.integers(6, 12))
            comps.append(Completion(
                token_ids=rng.integers(0, V, n).astype(np.int32),
                logprobs=np.full(n, -1.0, dtype=np.float32), version_segments=[(0, 0)],
                reward=float(ci), sampling_segments=sampling[2 * gi + ci]))
        groups.append(RolloutGroup(group_id=f"g{gi}", producer_id="p", prompt_id=f"q{gi}",
                                   prompt_token_ids=rng.integers(0, V, 5).astype(np.int32),
                                   completions=comps))
    return groups


def _expected(model, groups) -> list[float]:
    out = []
    for g in groups:
        for c in g.completions:
            ids = torch.from_numpy(np.concatenate([g.prompt_token_ids, c.token_ids]).astype(
                np.int64))[None]
            with torch.no_grad():
                z = model(ids).logits[0].double().numpy()
            temp, top_p, top_k = c.per_token_sampling()
            p0 = len(g.prompt_token_ids)
            out += [sampled_logprob(z[p0 - 1 + j], int(t), float(temp[j]), float(top_p[j]),
                               int(top_k[j])) for j, t in enumerate(c.token_ids)]
    return out


class _CastsFloatInputs(torch.nn.Module):
    """What FSDP2's MixedPrecisionPolicy(cast_forward_inputs=True) does to the forward's
    floating inputs, nested ones included."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, **kw):
        def cast(x):
            if isinstance(x, tuple):
                return tuple(cast(y) for y in x)
            return x.to(torch.bfloat16) if torch.is_tensor(x) and x.is_floating_point() else x
        return self.inner(**{k: cast(v) for k, v in kw.items()})


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("chunk", [0, 5])
def test_the_learners_logprobs_are_of_each_tokens_distribution(packing, chunk):
    model = _model()
    groups = _groups()
    pb = pack_groups(groups, True, 1e-6)
    b, attention = device_batch(pb, list(range(4)), packing, 0, torch.device("cpu"))
    assert set(b) >= {"temperature", "top_p", "top_k"}
    for policy in (Policy(model, chunk), _CastsFloatInputs(Policy(model, chunk))):
        with torch.no_grad():
            lp, _ = micro_batch_logprobs(policy, None, b, attention)
        np.testing.assert_allclose(lp[b["mask"]].double().numpy(), _expected(model, groups),
                                   atol=2e-5)


def test_an_untempered_batch_takes_the_plain_path():
    groups = _groups()
    for g in groups:
        for c in g.completions:
            c.sampling_segments = []
    pb = pack_groups(groups, True, 1e-6)
    assert pb.sampling is None
    b, _ = device_batch(pb, list(range(4)), False, 0, torch.device("cpu"))
    assert not {"temperature", "top_p", "top_k"} & set(b)
    # Temperatures alone: no top-p / top-k grid (no sort over the vocabulary).
    groups[0].completions[0].sampling_segments = [(0, 0.7, 1.0, 0)]
    b, _ = device_batch(pack_groups(groups, True, 1e-6), list(range(4)), False, 0,
                        torch.device("cpu"))
    assert "temperature" in b and "top_p" not in b
