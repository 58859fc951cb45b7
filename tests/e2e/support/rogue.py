"""A rogue producer for the fuzz test in test_faults.py (run as a script, its own process).

It listens to the learner's announcements like a producer, takes the identity of producer p0
(its incarnation, from the announced ``accepted`` counts) and, once the learner has published
``--min-version``, sends ``--count`` rollout groups to the learner's data socket. Each group is
well-formed (it decodes) but wrong for the run in one way drawn at random from
``buffer.checks.REASONS``; its seqs are far above any real one, so no real group is displaced.
It also sends ``--forge`` control messages on the learner's control socket, each forged in one
way drawn from ``FORGERIES`` (a Hello from a producer id the run does not have, an Ack, a
Heartbeat or a SyncReady in a real producer's name but from an incarnation the learner never
welcomed, or in the name of a producer that never said Hello), and reads the learner's answer to
each. Writes ``{"sent": {reason: n}, "forged": {reason: n}, "refused": {reason: n}, "version": v,
"incarnation": inc}`` to ``--out`` once all are sent and answered, then stays connected until its
stdin is closed.

    python tests/e2e/support/rogue.py --addr ipc://RUN/learner.sock --count 3000 --out sent.json \
        --group-size 4 --vocab 262 --max-tokens 8 --max-model-len 256 --window 2
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import zmq

from buffer import protocol
from buffer.checks import REASONS
from buffer.schema import Completion, RolloutGroup, encode
from buffer.transport import derive_ctl_addr, derive_pub_addr

SEQ_BASE = 10**9  # far above the seqs of the real p0
# Forged control messages, by the rejection reason the learner must count (rejected/<reason>).
FORGERIES = ("unexpected_producer", "stale_incarnation", "unknown_producer")


def forged_message(rng: random.Random, reason: str, i: int, version: int) -> protocol.Message:
    """A control message that decodes but that the learner must refuse for ``reason``."""
    if reason == "unexpected_producer":  # a Hello that would add a producer to wait for
        return protocol.Hello(producer_id=f"evil-{i}", incarnation=f"evil-{i}-inc",
                              policy_version=version, pid=1)
    who, inc = ("p0", f"p0-forged-{i}") if reason == "stale_incarnation" else \
        (f"p{rng.randrange(50, 99)}", f"ghost-{i}")
    kind = rng.randrange(3)
    if kind == 0:  # a negative ack would count a sync failure in a real producer's name
        return protocol.Ack(producer_id=who, incarnation=inc, version=version, ok=False,
                            error="forged")
    if kind == 1:
        return protocol.Heartbeat(producer_id=who, incarnation=inc, policy_version=version,
                                  stats={})
    return protocol.SyncReady(producer_id=who, incarnation=inc, purpose="weights", epoch=0,
                              version=version)


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


def forge(ctl: zmq.Socket, rng: random.Random, count: int, version: int,
          wait_s: float) -> tuple[Counter[str], Counter[str]]:
    """Send ``count`` forged control messages; return them by reason, and the learner's
    refusals (``Reply.reason``) of them. Every one must be answered: a refusal each."""
    forged: Counter[str] = Counter()
    for i in range(count):
        reason = rng.choice(FORGERIES)
        ctl.send(protocol.encode(forged_message(rng, reason, i, version), rid=i + 1))
        forged[reason] += 1
    refused: Counter[str] = Counter()
    deadline = time.monotonic() + wait_s
    while sum(refused.values()) < count and time.monotonic() < deadline:
        if ctl.poll(1000):
            _rid, reply = protocol.decode(ctl.recv())
            if isinstance(reply, protocol.Reply):
                refused[reply.reason if not reply.ok else "accepted"] += 1
    return forged, refused


def main(a: argparse.Namespace) -> dict:
    rng = random.Random(a.seed)
    ctx = zmq.Context()
    sub, push, ctl = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH), ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(derive_pub_addr(a.addr))
        push.connect(a.addr)
        ctl.connect(derive_ctl_addr(a.addr))
        deadline = time.monotonic() + a.wait_s
        version, incarnation = -1, None
        while version < a.min_version or incarnation is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"rogue: no announce of version >= {a.min_version} with p0's "
                                 f"incarnation within {a.wait_s}s")
            if sub.poll(1000):
                _rid, ann = protocol.decode(sub.recv(), 64 << 20)
                if isinstance(ann, protocol.Announce):
                    version = ann.version
                    incarnation = next((k for k in ann.accepted if k.startswith("p0-")), None)
        reasons = [r for r in REASONS if r != "version_behind" or version > a.window]
        sent: Counter[str] = Counter()
        for i in range(a.count):
            reason = rng.choice(reasons)
            push.send(encode(wrong_group(rng, reason, i, a, version, incarnation)))
            sent[reason] += 1
        forged, refused = forge(ctl, rng, a.forge, version, a.wait_s)
        result = {"sent": dict(sent), "forged": dict(forged), "refused": dict(refused),
                  "version": version, "incarnation": incarnation}
        Path(a.out).write_text(json.dumps(result))
        # Stay connected until told (stdin closes): libzmq drops the frames still waiting in
        # the learner's receive queue when their sender disconnects.
        sys.stdin.read()
    finally:
        sub.close(linger=0)
        ctl.close(linger=0)
        push.close(linger=120_000)  # every group queued reaches the learner's socket
        ctx.term()
    return result


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
    ap.add_argument("--forge", type=int, default=0, help="forged control messages to send")
    ap.add_argument("--min-version", type=int, default=0)
    ap.add_argument("--wait-s", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(json.dumps(main(args)), file=sys.stderr)
