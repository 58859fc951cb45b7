"""What every engine process of a run holds, producer or dedicated evaluator: its tokenizer,
rewards, endpoint to the learner and vLLM engine, built in that order and closed in reverse.

The engine is shut down once the process's requests are aborted (``shutdown_engine``) and then
collected at once: ``AsyncLLM.__del__`` calls shutdown() again, which fails noisily when it runs
at interpreter teardown. A stop (cancellation, Ctrl-C) is the run's normal end, not a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from buffer.staleness import versions_in_flight
from buffer.transport import ProducerEndpoint
from pipeline.config import RunConfig
from pipeline.keys import curve_keys
from pipeline.producer.engine import shutdown_engine
from pipeline.producer.rewards.runner import RewardSet


@dataclass
class EngineProcess:
    tokenizer: Any
    rewards: RewardSet
    endpoint: ProducerEndpoint
    engine: Any


@contextlib.asynccontextmanager
async def engine_process(cfg: RunConfig, index: int, model_path: str, share: tuple[int, int],
                         name: str) -> AsyncIterator[EngineProcess]:
    """The parts of engine ``index`` (``share``: its place among the engines of its machine,
    ``pipeline.producer.engine.cpu_cores``); ``name`` is the process's name in log lines."""
    from transformers import AutoTokenizer

    from pipeline.producer.engine import build_engine

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rewards = RewardSet(cfg.rewards.specs, on_failure=cfg.rewards.on_failure,
                        pool_workers=cfg.rewards.pool_workers)
    endpoint = ProducerEndpoint(cfg.bind_addr, curve=curve_keys(cfg, "producer"))
    t = cfg.train
    lora = cfg.adapter_plan.serving == "lora"
    parts = EngineProcess(tokenizer, rewards, endpoint, build_engine(
        cfg.model, cfg.engine, model_path, cfg.engine.seed + index,
        lora_rank=t.lora_rank if lora else 0, max_loras=versions_in_flight(t.max_staleness),
        share=share))
    failed = True
    try:
        yield parts
        failed = False
    except (asyncio.CancelledError, KeyboardInterrupt):  # stopped: the run's normal end
        failed = False
        raise
    finally:
        endpoint.close()
        rewards.close()
        shutdown_engine(parts.engine, name, failed)
        parts.engine = None
        gc.collect()
