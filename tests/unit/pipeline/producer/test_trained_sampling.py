"""Which sampling options the learner can train, what a completion records of them, and how an
episode's turns carry theirs (pure logic: no engine)."""

from __future__ import annotations

import numpy as np
import pytest

from buffer.schema import Completion
from pipeline.producer.episode import Transcript
from pipeline.producer.trained_sampling import (
    DEFAULT,
    UntrainableSampling,
    add_segment,
    distribution,
    engine_options,
)


def test_the_replayed_options_and_the_neutral_ones_are_accepted():
    assert distribution({}) == DEFAULT
    assert distribution({"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_tokens": 8,
                         "stop": ["\n"], "seed": 3, "ignore_eos": True}) == (0.7, 0.9, 20)
    assert distribution({"top_k": -1})[2] == 0  # vLLM's other "off"
    assert distribution({"min_p": 0.0, "repetition_penalty": 1.0, "logit_bias": None}) == DEFAULT
    assert engine_options(0.7, 1.0, 0) == {"temperature": 0.7, "top_p": 1.0}
    assert engine_options(1.0, 0.9, 20)["top_k"] == 20


@pytest.mark.parametrize("opts, says", [
    ({"min_p": 0.05}, "min_p=0.05"),
    ({"repetition_penalty": 1.1}, "repetition_penalty=1.1"),
    ({"presence_penalty": 0.5}, "presence_penalty=0.5"),
    ({"logit_bias": {3: 5.0}}, "logit_bias"),
    ({"min_tokens": 4}, "min_tokens=4"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ({"frobnicate": 1}, "'frobnicate' is not one the learner can train"),
    ({"temperature": 0.0}, "temperature 0 cannot be trained"),
    ({"top_p": 0.0}, "top_p 0 must be in (0, 1]"),
])
def test_a_distribution_the_learner_cannot_recompute_is_refused_by_name(opts, says):
    with pytest.raises(UntrainableSampling) as e:
        distribution(opts, "episode turn")
    assert says in str(e.value) and str(e.value).startswith("episode turn: ")
    assert "\n" not in str(e.value)


def test_a_segment_is_added_only_where_the_distribution_changes():
    segs: list = []
    add_segment(segs, 0, DEFAULT)
    assert segs == []  # the implicit distribution before the first segment
    add_segment(segs, 0, (0.5, 1.0, 0))
    add_segment(segs, 4, (0.5, 1.0, 0))
    add_segment(segs, 9, (1.5, 1.0, 20))
    add_segment(segs, 12, DEFAULT)
    assert segs == [(0, 0.5, 1.0, 0), (9, 1.5, 1.0, 20), (12, 1.0, 1.0, 0)]
    add_segment(segs, 12, (1.5, 1.0, 20))  # the same start again: replaced, then merged
    assert segs == [(0, 0.5, 1.0, 0), (9, 1.5, 1.0, 20)]


def _turn(n: int, sampling: list) -> Completion:
    return Completion(token_ids=np.arange(n, dtype=np.int32), logprobs=np.full(n, -1.0,
                      dtype=np.float32), version_segments=[(0, 0)], sampling_segments=sampling)


def test_an_episode_carries_each_turns_distribution_to_its_tokens():
    t = Transcript()
    t.add_generated(_turn(3, [(0, 0.5, 1.0, 0)]))
    t.add_env([7, 7], version=0)
    t.add_generated(_turn(2, [(0, 1.5, 1.0, 20)]))
    t.add_generated(_turn(2, []))  # the run's own (untempered) sampling
    comp = t.completion(0)
    assert comp.sampling_segments == [(0, 0.5, 1.0, 0), (5, 1.5, 1.0, 20), (7, 1.0, 1.0, 0)]
    temp, top_p, top_k = comp.per_token_sampling()
    assert temp.tolist() == [0.5] * 5 + [1.5] * 2 + [1.0] * 2  # env tokens: masked anyway
    assert top_k.tolist() == [0] * 5 + [20] * 2 + [0] * 2
    assert top_p.tolist() == [1.0] * 9


def test_an_untempered_episode_records_nothing():
    t = Transcript()
    t.add_generated(_turn(3, []))
    t.add_generated(_turn(2, []))
    assert t.completion(0).sampling_segments == []
