"""A vLLM CPU engine on an event loop of its own, for the e2e tests that swap weights into it
(tests/e2e/test_sync_*.py and the GPU transport tests): the engine, a probe that reads its greedy
tokens and logprobs, and a HF directory holding other weights for a fresh engine to compare with.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from pathlib import Path

from safetensors.torch import save_file

from bench.sync_bench import generate

VOCAB = 260
PROBE = [ord(c) for c in "The quick brown fox jumps over the lazy dog. Once upon a time"]


class EngineLoop:
    """An AsyncLLM bound to an event loop running in a thread (pytest-asyncio is not used)."""

    def __init__(self, model_dir: Path, tensor_parallel_size: int = 1):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = self.run(self._build(model_dir, tensor_parallel_size), timeout=600)
        self._version = 0

    @staticmethod
    async def _build(model_dir: Path, tensor_parallel_size: int = 1):
        from pipeline.config import EngineConfig, ModelConfig
        from pipeline.producer.engine import build_engine

        eng = EngineConfig(max_model_len=2048, enable_chunked_prefill=True,
                           max_num_batched_tokens=256, max_num_seqs=128,
                           enable_prefix_caching=True, tensor_parallel_size=tensor_parallel_size)
        return build_engine(ModelConfig(dtype="bfloat16"), eng, str(model_dir), seed=0)

    def run(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def next_version(self) -> int:
        self._version += 1
        return self._version

    def close(self) -> None:
        if self.engine is not None:
            async def shutdown():
                self.engine.shutdown()
            self.run(shutdown(), timeout=120)
            self.engine = None
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)
            self.loop.close()


def hf_dir_with(model_dir: Path, tensors: dict, dest: Path) -> Path:
    """A copy of the HF model dir ``model_dir`` whose weights are ``tensors`` (for a fresh
    engine that checks a swap by effect)."""
    shutil.copytree(model_dir, dest)
    for f in dest.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


async def probe(engine, tracker) -> tuple[list[int], list[float]]:
    g = await generate(engine, tracker, f"probe-{time.monotonic_ns()}", PROBE, max_tokens=16,
                       temperature=0.0)
    return g.tokens, g.logprobs
