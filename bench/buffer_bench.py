"""Throughput benchmark of the rollout path: encode -> ZMQ (tcp loopback) -> decode -> buffer.

    python -m bench.buffer_bench [--groups N] [--completions G] [--tokens T] [--prompt-tokens P]

A producer process (spawned, with its own ProducerEndpoint) sends N groups; the learner side runs
the real Receiver into a RolloutBuffer while a consumer coroutine takes batches with get_batch.
The clock runs from the first group received to the last group served.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time

import numpy as np

from buffer.ports import free_tcp_port_pair
from buffer.schema import Completion, RolloutGroup
from buffer.store import RolloutBuffer
from buffer.transport import LearnerEndpoint, ProducerEndpoint, Receiver


def make_group(i: int, completions: int, tokens: int, prompt_tokens: int,
               rng: np.random.Generator) -> RolloutGroup:
    return RolloutGroup(
        group_id=f"bench-{i}",
        producer_id="bench",
        prompt_id=f"prompt-{i}",
        prompt_token_ids=rng.integers(0, 150_000, prompt_tokens, dtype=np.int32),
        completions=[
            Completion(
                token_ids=rng.integers(0, 150_000, tokens, dtype=np.int32),
                logprobs=-rng.exponential(1.0, tokens).astype(np.float32),
                version_segments=[(0, 0)],
                reward=float(rng.random()),
                reward_breakdown={"correct": 1.0, "format": 0.5},
                finish_reason="length",
            )
            for _ in range(completions)
        ],
        timing={"admitted_at": time.time(), "generated_s": 1.0, "reward_s": 0.01},
        metadata={"seq": i},
    )


def _producer(addr: str, n: int, completions: int, tokens: int, prompt_tokens: int) -> None:
    async def main() -> None:
        rng = np.random.default_rng(0)
        templates = [make_group(i, completions, tokens, prompt_tokens, rng) for i in range(8)]
        ep = ProducerEndpoint(addr, sndhwm=64)
        try:
            for i in range(n):
                g = templates[i % len(templates)]
                g.group_id = f"bench-{i}"
                g.metadata["seq"] = i
                await ep.send(g)
        finally:
            ep.close()

    asyncio.run(main())


async def _learner(addr: str, n: int, batch: int) -> tuple[float, int, RolloutBuffer]:
    ep = LearnerEndpoint(addr, rcvhwm=64)
    store = RolloutBuffer(capacity=max(256, 2 * batch), max_staleness=4)
    recv_task = asyncio.create_task(Receiver(ep, store).run())
    try:
        got = await store.get_batch(1, learner_version=0, timeout=60)
        t0 = time.perf_counter()  # from the first group received
        served = len(got)
        while served < n:
            got = await store.get_batch(min(batch, n - served), learner_version=0, timeout=60)
            served += len(got)
        elapsed = time.perf_counter() - t0
        return elapsed, ep.bytes_received, store
    finally:
        recv_task.cancel()
        ep.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--groups", type=int, default=20_000, help="groups to send")
    p.add_argument("--completions", type=int, default=8, help="completions per group")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per completion")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt tokens per group")
    p.add_argument("--batch", type=int, default=32, help="groups per get_batch")
    args = p.parse_args(argv)

    addr = f"tcp://127.0.0.1:{free_tcp_port_pair()}"
    proc = mp.get_context("spawn").Process(
        target=_producer,
        args=(addr, args.groups, args.completions, args.tokens, args.prompt_tokens),
        daemon=True,
    )
    proc.start()
    try:
        elapsed, nbytes, store = asyncio.run(_learner(addr, args.groups, args.batch))
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
    st = store.stats
    gps = args.groups / elapsed
    mbps = nbytes / elapsed / 1e6
    print(f"groups:        {args.groups} x {args.completions} completions x {args.tokens} tokens "
          f"(+{args.prompt_tokens} prompt tokens)")
    print(f"frame size:    {nbytes / max(1, st.received) / 1024:.1f} KiB")
    print(f"elapsed:       {elapsed:.3f} s")
    print(f"throughput:    {gps:,.0f} groups/s, {mbps:,.0f} MB/s, "
          f"{gps * args.completions * args.tokens / 1e6:.2f} M completion tokens/s")
    print(f"buffer stats:  {st.to_dict()}")
    print(f"SUMMARY bench.buffer_bench groups_per_s={gps:.0f} MB_per_s={mbps:.0f} "
          f"groups={args.groups} "
          f"completions={args.completions} tokens={args.tokens} served={st.served} "
          f"rejected={st.rejected}")


if __name__ == "__main__":
    main()
