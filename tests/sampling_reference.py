"""An independent recomputation of the distribution a token was sampled from, for the tests of
the learner's and the engine's logprobs (numpy, float64; no project code)."""

from __future__ import annotations

import numpy as np


def sampled_logprob(z: np.ndarray, tok: int, temp: float, top_p: float, top_k: int,
                    keep_sampled: bool = True) -> float:
    """log p(tok) from logits ``z``: softmax(z / temp) over the k largest (ties kept), then
    over the smallest nucleus whose mass before a token (largest first) is below top_p,
    renormalised; with ``keep_sampled`` the token is kept whatever the cut (the learner's rule),
    without it a token outside the cut is -inf (the sampler's)."""
    q = np.exp((z - z.max()) / temp)
    q /= q.sum()
    keep = np.ones(len(q), dtype=bool)
    if top_k:
        keep &= q >= np.sort(q)[-top_k]
    if top_p < 1:
        m = np.where(keep, q, 0.0)
        m /= m.sum()
        order = np.argsort(-m, kind="stable")
        before = np.cumsum(m[order]) - m[order]
        nucleus = np.zeros(len(q), dtype=bool)
        nucleus[order] = before < top_p
        keep &= nucleus
    if keep_sampled:
        keep[tok] = True
    with np.errstate(divide="ignore"):
        return float(np.log(np.where(keep[tok], q[tok], 0.0) / q[keep].sum()))
