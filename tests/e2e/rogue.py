"""A rogue producer for the fuzz test in test_faults.py (run as a script, its own process).

It listens to the learner's announcements like a producer, takes the identity of producer p0
(its incarnation, from the announced ``accepted`` counts) and, once the learner has published
``--min-version``, sends ``--count`` rollout groups to the learner's data socket. Each group is
well-formed (it decodes) but wrong for the run in one way drawn at random from
``buffer.checks.REASONS``; its seqs are far above any real one, so no real group is displaced.
Writes ``{"sent": {reason: n}, "version": v, "incarnation": inc}`` to ``--out``.

    python tests/e2e/rogue.py --addr ipc://RUN/learner.sock --count 3000 --out sent.json \
        --group-size 4 --vocab 262 --max-tokens 8 --max-model-len 256 --window 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from buffer.checks import REASONS
from buffer.schema import Completion, RolloutGroup
from buffer.transport import ProducerEndpoint

SEQ_BASE = 10**9  # far above the seqs of the real p0


def wrong_group(rng: random.Random, reason: str, i: int, a: argparse.Namespace, version: int,
                incarnation: str) -> RolloutGroup:
    """A group that decodes but fails exactly the check ``reason`` of the run ``a``."""
    g, vocab = a.group_size, a.vocab
    n = g
    plen, tokens = 5, 4
    versions = [version] * g
    rewards = [float(rng.random()) for _ in range(g)]
    logprob = -0.5
    prompt = [rng.randrange(vocab) for _ in range(plen)]
    comp_tokens = [[rng.randrange(vocab) for _ in range(tokens)] for _ in range(g)]
    k = rng.randrange(g)  # the completion that carries the fault
    if reason == "group_size":
        n = rng.choice([x for x in (1, g - 1, g + 1, 2 * g) if x >= 1 and x != g])
        comp_tokens = [[rng.randrange(vocab) for _ in range(tokens)] for _ in range(n)]
        versions, rewards = [version] * n, [0.0] * n
        k = 0
    elif reason == "empty_prompt":
        prompt = []
    elif reason == "token_out_of_vocab":
        bad = rng.randrange(vocab, 2**31 - 1)
        if rng.random() < 0.5:
            prompt[rng.randrange(plen)] = bad
        else:
            comp_tokens[k][rng.randrange(tokens)] = bad
    elif reason == "too_many_tokens":
        comp_tokens[k] = [rng.randrange(vocab) for _ in range(a.max_tokens + rng.randint(1, 5))]
    elif reason == "too_long":
        prompt = [rng.randrange(vocab) for _ in range(a.max_model_len - tokens + rng.randint(1, 3))]
    elif reason == "version_ahead":
        versions[k] = version + 10**6  # still ahead when the learner has moved on
    elif reason == "version_behind":
        versions[k] = rng.randrange(version - a.window)  # below max(0, version - window)
    elif reason == "reward_out_of_range":
        rewards[k] = rng.choice([1.0, -1.0]) * 10 ** rng.uniform(10, 300)
    elif reason == "logprob_out_of_range":
        logprob = -(10 ** rng.uniform(4.5, 30))  # finite, so it decodes; > 0 would not
    else:
        raise ValueError(reason)
    comps = [Completion(token_ids=np.asarray(t, dtype=np.int32),
                        logprobs=np.full(len(t), logprob if c == k else -0.5, dtype=np.float32),
                        version_segments=[(0, versions[c])], reward=rewards[c],
                        finish_reason="length")
             for c, t in enumerate(comp_tokens)]
    return RolloutGroup(group_id=f"rogue-{i}-{reason}", producer_id="p0",
                        prompt_id=f"rogue-{i}", prompt_token_ids=np.asarray(prompt, np.int32),
                        completions=comps,
                        metadata={"incarnation": incarnation, "seq": SEQ_BASE + i})


async def main(a: argparse.Namespace) -> dict:
    rng = random.Random(a.seed)
    ep = ProducerEndpoint(a.addr, sndhwm=1000)
    try:
        deadline = time.monotonic() + a.wait_s
        version, incarnation = -1, None
        while version < a.min_version or incarnation is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"rogue: no announce of version >= {a.min_version} with p0's "
                                 f"incarnation within {a.wait_s}s")
            ann = await ep.recv_announce(timeout=1.0)
            if ann is not None:
                version = ann.version
                incarnation = next((k for k in ann.accepted if k.startswith("p0-")), None)
        reasons = [r for r in REASONS if r != "version_behind" or version > a.window]
        sent: Counter[str] = Counter()
        for i in range(a.count):
            reason = rng.choice(reasons)
            await ep.send(wrong_group(rng, reason, i, a, version, incarnation), timeout=120)
            sent[reason] += 1
    finally:
        ep.close()  # LINGER: what is queued still goes out
    return {"sent": dict(sent), "version": version, "incarnation": incarnation}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--addr", required=True)
    ap.add_argument("--count", type=int, default=3000)
    ap.add_argument("--out", required=True)
    ap.add_argument("--group-size", type=int, required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--window", type=int, required=True,
                    help="train.max_staleness + sync.keep_snapshots of the run")
    ap.add_argument("--min-version", type=int, default=0)
    ap.add_argument("--wait-s", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    result = asyncio.run(main(args))
    Path(args.out).write_text(json.dumps(result))
    print(json.dumps(result), file=sys.stderr)
