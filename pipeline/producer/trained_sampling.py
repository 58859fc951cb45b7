"""Which sampling options the learner can train, and what each request records of them (pure
logic, no engine).

The policy is the distribution the engine samples from: softmax(logits / temperature), cut to
the top-k tokens and then to the top-p nucleus when those are set (vLLM's order). The engine
returns the logprob of every sampled token under exactly that distribution (``logprobs_mode``
``processed_logprobs``, set by ``pipeline.producer.engine``), and each completion carries the
(temperature, top_p, top_k) its tokens were drawn with (``Completion.sampling_segments``), so
the learner recomputes the same distribution from its own logits
(``pipeline.learner.logprobs``).

Invariants:
- A request's options either change nothing the learner computes (length, stops, seed, output
  format) or are one of the three the learner replays; anything else that reshapes the
  distribution (penalties, min-p, logit bias, allowed or bad words, min_tokens, greedy) is
  refused with ``UntrainableSampling`` before the request reaches the engine, never sampled
  silently.
- A completion drawn at (1.0, 1.0, 0) records no segment, so its frame is that of a build
  without temperatures.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DEFAULT = (1.0, 1.0, 0)  # (temperature, top_p, top_k): untempered, untruncated

# SamplingParams options that leave every token's probability unchanged.
NEUTRAL = frozenset({
    "n", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output",
    "skip_special_tokens", "spaces_between_special_tokens", "seed", "detokenize", "logprobs",
    "flat_logprobs", "output_kind", "truncate_prompt_tokens",
})
REPLAYED = frozenset({"temperature", "top_p", "top_k"})

# Options that reshape the distribution, with the value that leaves it alone.
_NEUTRAL_VALUES: dict[str, Any] = {
    "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "min_tokens": 0, "logit_bias": None, "allowed_token_ids": None, "bad_words": None,
    "logits_processors": None, "structured_outputs": None, "guided_decoding": None,
}

MIN_TEMPERATURE = 1e-5  # vLLM samples greedily below this: a point mass has no gradient


class UntrainableSampling(ValueError):
    """A sampling option whose distribution the learner cannot recompute (one line naming it)."""


def distribution(opts: Mapping[str, Any], where: str = "generation") -> tuple[float, float, int]:
    """(temperature, top_p, top_k) of a request's options, top_k 0 when off; raises
    ``UntrainableSampling`` naming the first option the learner could not train."""
    for name, value in opts.items():
        if name in NEUTRAL or name in REPLAYED:
            continue
        if name not in _NEUTRAL_VALUES:
            raise UntrainableSampling(
                f"{where}: sampling option {name!r} is not one the learner can train (it replays "
                f"temperature, top_p and top_k; neutral: {', '.join(sorted(NEUTRAL))})")
        if value not in (None, _NEUTRAL_VALUES[name]) and value != {} and value != []:
            raise UntrainableSampling(
                f"{where}: sampling option {name}={value!r} changes the distribution the engine "
                f"samples in a way the learner cannot recompute (it replays temperature, top_p "
                f"and top_k); leave it at {_NEUTRAL_VALUES[name]!r}")
    temperature = float(opts.get("temperature", DEFAULT[0]))
    top_p = float(opts.get("top_p", DEFAULT[1]))
    top_k = int(opts.get("top_k") or 0)
    if not temperature >= MIN_TEMPERATURE or temperature == float("inf"):
        raise UntrainableSampling(
            f"{where}: temperature {temperature:g} cannot be trained (below {MIN_TEMPERATURE:g} "
            f"the engine samples greedily: a point mass with no gradient); use a temperature > 0")
    if not 0 < top_p <= 1:
        raise UntrainableSampling(f"{where}: top_p {top_p:g} must be in (0, 1]")
    top_k = max(top_k, 0) if top_k != -1 else 0
    return temperature, top_p, top_k


def engine_options(temperature: float, top_p: float, top_k: int) -> dict[str, Any]:
    """The SamplingParams keywords of a distribution (top_k only when set: vLLM's 'off' value
    differs across versions)."""
    opts: dict[str, Any] = {"temperature": temperature, "top_p": top_p}
    if top_k > 0:
        opts["top_k"] = top_k
    return opts


def add_segment(segments: list[tuple[int, float, float, int]], start: int,
                dist: tuple[float, float, int]) -> None:
    """Record that tokens from ``start`` on were drawn from ``dist``: a segment only where the
    distribution changes (the implicit one before the first segment is ``DEFAULT``)."""
    last = segments[-1][1:] if segments else DEFAULT
    if tuple(dist) != tuple(last):
        if segments and segments[-1][0] == start:
            segments[-1] = (start, *dist)
            if (segments[-2][1:] if len(segments) > 1 else DEFAULT) == tuple(dist):
                segments.pop()
        else:
            segments.append((start, *dist))
