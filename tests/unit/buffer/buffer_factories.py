"""Builders of valid messages and strategies shared by the buffer tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from buffer.schema import Completion, RolloutGroup


def make_completion(n_tokens: int = 16, version: int = 0, seed: int = 0, **kw) -> Completion:
    rng = np.random.default_rng(seed)
    return Completion(
        token_ids=rng.integers(0, 50_000, n_tokens, dtype=np.int32),
        logprobs=-rng.exponential(1.0, n_tokens).astype(np.float32),
        version_segments=kw.pop("version_segments", [(0, version)]),
        reward=kw.pop("reward", 1.0),
        reward_breakdown=kw.pop("reward_breakdown", {"correct": 1.0}),
        finish_reason=kw.pop("finish_reason", "stop"),
    )


def make_group(
    group_id: str = "g0",
    version: int = 0,
    producer_id: str = "p0",
    n_completions: int = 2,
    n_tokens: int = 16,
    seed: int = 0,
) -> RolloutGroup:
    return RolloutGroup(
        group_id=group_id,
        producer_id=producer_id,
        prompt_id=f"prompt-{group_id}",
        prompt_token_ids=np.arange(8, dtype=np.int32),
        completions=[
            make_completion(n_tokens, version, seed=seed + i) for i in range(n_completions)
        ],
        timing={"admitted_at": 123.5},
        metadata={"seq": 1, "source": "test"},
    )


def free_tcp_port_pair() -> int:
    """A port p with p, p+1 and p+2 free on 127.0.0.1 (PULL at p, PUB at p+1, ROUTER at p+2)."""
    from buffer.ports import free_tcp_port_pair as free_ports

    return free_ports()


# ---- hypothesis strategies ------------------------------------------------------------------

texts = st.text(max_size=20)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
float_maps = st.dictionaries(texts, finite, max_size=4)


@st.composite
def completions(draw) -> Completion:
    n = draw(st.integers(0, 64))
    tok = np.asarray(draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)),
                     dtype=np.int32)
    lp = np.asarray(
        draw(st.lists(st.floats(-1e4, 0.0, width=32), min_size=n, max_size=n)),
        dtype=np.float32,
    )
    n_segs = draw(st.integers(1, max(1, min(n, 4))))
    starts = [0, *sorted(draw(st.sets(st.integers(1, max(1, n - 1)), max_size=n_segs - 1)))]
    if n <= 1:
        starts = [0]
    base = draw(st.integers(0, 1000))
    bumps = draw(st.lists(st.integers(0, 3), min_size=len(starts), max_size=len(starts)))
    versions = list(np.cumsum(bumps) + base)
    return Completion(
        token_ids=tok,
        logprobs=lp,
        version_segments=[(int(s), int(v)) for s, v in zip(starts, versions, strict=True)],
        reward=draw(finite),
        reward_breakdown=draw(float_maps),
        finish_reason=draw(texts),
    )


@st.composite
def groups(draw) -> RolloutGroup:
    return RolloutGroup(
        group_id=draw(texts),
        producer_id=draw(texts),
        prompt_id=draw(texts),
        prompt_token_ids=np.asarray(
            draw(st.lists(st.integers(0, 2**31 - 1), max_size=32)), dtype=np.int32
        ),
        completions=draw(st.lists(completions(), min_size=1, max_size=4)),
        timing=draw(float_maps),
        metadata=draw(
            st.dictionaries(texts, st.one_of(texts, st.integers(-(2**63), 2**63 - 1), finite),
                            max_size=4)
        ),
    )


def producer_process_main(addr: str, producer_id: str, n_groups: int, sndhwm: int) -> None:
    """Body of a spawned producer: Hello (answered), n_groups numbered groups, then wait for the
    learner's Announce (so nothing is still queued when the socket closes)."""
    import asyncio
    import os

    from buffer.protocol import Hello, Welcome
    from buffer.transport import ProducerEndpoint

    async def main() -> None:
        ep = ProducerEndpoint(addr, sndhwm=sndhwm)
        try:
            hello = Hello(producer_id=producer_id, incarnation=f"{producer_id}-{os.getpid()}",
                          policy_version=0, pid=os.getpid())
            assert isinstance(await ep.call(hello, 30), Welcome)
            for seq in range(n_groups):
                g = make_group(f"{producer_id}-{seq}", producer_id=producer_id, n_tokens=32,
                               seed=seq)
                g.metadata["seq"] = seq
                await ep.send(g, timeout=30)
            announce = await ep.recv_announce(timeout=60)
            assert announce is not None, "no Announce from the learner"
        finally:
            ep.close()

    asyncio.run(main())
