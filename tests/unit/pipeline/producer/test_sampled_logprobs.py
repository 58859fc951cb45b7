"""pipeline.producer.loop.sampled_logprobs: behaviour logprobs from vLLM's two containers."""

from __future__ import annotations

import math

from vllm.logprobs import FlatLogprobs, Logprob

from pipeline.producer.group import sampled_logprobs


def test_flat_logprobs_with_only_the_sampled_token_are_read_directly():
    flat = FlatLogprobs()
    for tok, lp in [(5, -0.5), (7, -1.25), (9, -3.0)]:
        flat.append({tok: Logprob(logprob=lp, rank=1)})
    assert sampled_logprobs(flat, [5, 7, 9]) == [-0.5, -1.25, -3.0]


def test_flat_logprobs_with_extra_ranks_fall_back_to_per_position_lookup():
    flat = FlatLogprobs()
    flat.append({5: Logprob(-0.5, 1), 6: Logprob(-2.0, 2)})
    flat.append({8: Logprob(-0.1, 1), 7: Logprob(-4.0, 3)})
    assert sampled_logprobs(flat, [5, 7]) == [-0.5, -4.0]


def test_dict_logprobs_and_missing_entries():
    dicts = [{5: Logprob(-0.5, 1)}, None, {1: Logprob(-1.0, 1)}]
    out = sampled_logprobs(dicts, [5, 6, 7])
    assert out[0] == -0.5 and math.isnan(out[1]) and math.isnan(out[2])
    assert all(math.isnan(x) for x in sampled_logprobs(None, [1, 2]))
