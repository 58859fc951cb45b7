"""Episodes run by tests/e2e/test_episodes.py inside a real producer: two turns around a slow
tool (so weight swaps land between the turns), and a tool that hangs for some prompts. Each
episode appends what the engine tagged its turns with to a JSONL log the test reads (and, as it
starts, its prompt id and index to ``<log>.started``)."""

from __future__ import annotations

import asyncio
import json
import time


def slow_tool(delay_s: float) -> str:
    time.sleep(delay_s)
    return "42"


def hanging_tool() -> str:
    time.sleep(3600)
    return "never"


async def two_turns(
    ctx, prompt, log: str = "", tool_delay_s: float = 0.0, hang_every: int = 0,
    slow_every: int = 0, slow_delay_s: float = 0.0, **meta
):
    """Turn 1, the tool's answer, turn 2; the first episode of every ``hang_every``-th prompt
    calls a tool that hangs (the run's episode.tool_timeout_s must end it). Prompts numbered
    1 modulo ``slow_every`` also wait ``slow_delay_s`` between their turns (not in a tool):
    their groups finish well after the others, so the learner trains on the others and
    publishes a version while these wait between their turns, however busy the machine."""
    entry = {"prompt_id": meta["prompt_id"], "index": ctx.index}
    if log:
        with open(log + ".started", "a") as fh:
            fh.write(json.dumps(entry) + "\n")
    turns = [await ctx.generate(max_tokens=6)]
    number = int(str(meta["prompt_id"]).rsplit("-", 1)[-1])
    try:
        if hang_every and ctx.index == 0 and number % hang_every == 0:
            await ctx.tool(hanging_tool)
        if slow_every and number % slow_every == 1:
            await asyncio.sleep(slow_delay_s)  # the environment, outside the tool's timeout
        result = await ctx.tool(slow_tool, tool_delay_s)
        turns.append(await ctx.generate(f" -> {result} ", max_tokens=6))
    finally:
        entry["versions"] = [t.versions for t in turns]
        entry["masked_spans"] = ctx.transcript.masked_spans
        with open(log, "a") as fh:
            fh.write(json.dumps(entry) + "\n")
    return None  # the run's reward functions score the transcript


async def tempered_turns(ctx, prompt, **meta):
    """Three turns drawn from three distributions (temperature 0.5; 1.5 with top-k 20; the
    run's own), a tool answer between the first two: the learner must recompute each turn's
    tokens under the distribution that turn was drawn from."""
    await ctx.generate(max_tokens=5, temperature=0.5)
    await ctx.generate(" -> 42 ", max_tokens=5, temperature=1.5, top_k=20)
    await ctx.generate(max_tokens=5)
    return None
