"""buffer.checks: every reason a decoded group is rejected for, one group per reason (each
also round-trips the wire format first: these groups are well-formed, only wrong for the run),
and the buffer's accounting of rejected groups (put/reject/recheck, snapshots)."""

from __future__ import annotations

import numpy as np
import pytest

from buffer.checks import REASONS, RunLimits, check_group
from buffer.schema import Completion, RolloutGroup, decode, encode
from buffer.store import RolloutBuffer

LIMITS = RunLimits(group_size=4, vocab_size=100, max_tokens=8, max_model_len=20,
                   learner_version=5, oldest_version=2)


def good(gid: str = "g", version: int = 4, plen: int = 6, n: int = 4, tokens: int = 5
         ) -> RolloutGroup:
    rng = np.random.default_rng(0)
    return RolloutGroup(
        group_id=gid, producer_id="p0", prompt_id=gid,
        prompt_token_ids=rng.integers(0, 100, plen).astype(np.int32),
        completions=[Completion(token_ids=rng.integers(0, 100, tokens).astype(np.int32),
                                logprobs=-rng.random(tokens).astype(np.float32),
                                version_segments=[(0, version)], reward=float(i),
                                reward_breakdown={"r": float(i)}) for i in range(n)])


def _bad(reason: str) -> RolloutGroup:
    g = good(reason)
    c = g.completions[1]
    if reason == "group_size":
        g.completions = g.completions[:1]
    elif reason == "empty_prompt":
        g.prompt_token_ids = np.zeros(0, dtype=np.int32)
    elif reason == "token_out_of_vocab":
        c.token_ids[2] = 100
    elif reason == "too_many_tokens":
        c.token_ids = np.arange(9, dtype=np.int32)
        c.logprobs = -np.ones(9, dtype=np.float32)
    elif reason == "too_long":
        g.prompt_token_ids = np.arange(15, dtype=np.int32)
        c.token_ids = np.arange(6, dtype=np.int32)
        c.logprobs = -np.ones(6, dtype=np.float32)
    elif reason == "version_ahead":
        c.version_segments = [(0, 5), (3, 6)]
    elif reason == "version_behind":
        c.version_segments = [(0, 1), (2, 4)]
    elif reason == "reward_out_of_range":
        c.reward = 1e12
    elif reason == "logprob_out_of_range":
        c.logprobs[0] = -1e5
    else:
        raise AssertionError(reason)
    return decode(encode(g))  # well-formed: the decoder accepts it


def test_a_good_group_passes():
    assert check_group(decode(encode(good())), LIMITS) is None
    edge = good(version=2, plen=12, tokens=8)  # oldest version, longest allowed, all at limits
    edge.completions[0].logprobs[:] = 0.0
    edge.completions[0].reward = -1e9
    assert check_group(edge, LIMITS) is None


@pytest.mark.parametrize("reason", REASONS)
def test_each_wrong_group_is_rejected_with_its_reason(reason):
    bad = check_group(_bad(reason), LIMITS)
    assert bad is not None and bad.reason == reason, bad
    assert bad.detail and "\n" not in bad.detail


def test_a_breakdown_value_out_of_range_rejects_too():
    g = good()
    g.completions[0].reward_breakdown["r"] = float("nan")  # only a local group can hold NaN
    assert check_group(g, LIMITS).reason == "reward_out_of_range"


def test_limits_are_validated():
    with pytest.raises(ValueError, match="group_size"):
        RunLimits(group_size=0, vocab_size=1, max_tokens=1, max_model_len=1, learner_version=0)
    with pytest.raises(ValueError, match="oldest_version"):
        RunLimits(group_size=2, vocab_size=1, max_tokens=1, max_model_len=1, learner_version=1,
                  oldest_version=2)


def test_rejected_groups_keep_the_buffer_sum_exact_and_survive_a_snapshot():
    buf = RolloutBuffer(capacity=4, max_staleness=None)
    for i in range(3):
        buf.put(good(f"ok{i}"))
    buf.reject(_bad("empty_prompt"), "empty_prompt")
    assert buf.take(1, learner_version=5) is not None
    st = buf.stats
    assert st.rejected_groups == {"empty_prompt": 1}
    assert st.received == st.served + st.dropped_stale + st.dropped_capacity + st.size + 1

    # A checkpoint holding a bad group: the resumed buffer is re-checked against the run.
    buf.put(_bad("token_out_of_vocab"))
    back = RolloutBuffer.restore(buf.snapshot(), capacity=4, max_staleness=None)
    assert len(back) == 3 and back.stats.rejected_groups == {"empty_prompt": 1}
    out = back.recheck(lambda g: check_group(g, LIMITS))
    assert [(g.group_id, r.reason) for g, r in out] == [("token_out_of_vocab",
                                                          "token_out_of_vocab")]
    st = back.stats
    assert st.rejected_groups == {"empty_prompt": 1, "token_out_of_vocab": 1}
    assert len(back) == 2 and st.received == 5
    assert st.received == (st.served + st.dropped_stale + st.dropped_capacity + st.size
                           + sum(st.rejected_groups.values()))
