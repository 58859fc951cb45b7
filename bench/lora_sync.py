"""LoRA sync cost, adapter-only vs merged weights: bytes per version and swap time on one engine.

For each path: a LoRA PolicyTrainer (peft) gives a version's snapshot (``sync.lora_adapters``
auto: the adapter; off: the targeted weights merged), written as a snapshot file; a real vLLM
engine then swaps to it through the producer's own code (merged: FileTransport in the sync
barrier; adapter: AdapterSet.swap, no pause) while requests run.

    python -m bench.lora_sync --model smollm2-135m --rank 16 --versions 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from functools import partial
from pathlib import Path

import torch


async def _swaps(engine, refs, adapters) -> list[dict[str, float]]:
    from vllm import SamplingParams

    from sync.barrier import RequestTracker, SwapBarrier
    from sync.transfer import FileTransport

    tracker = RequestTracker()
    barrier = SwapBarrier(engine, tracker)
    ft = FileTransport(engine)
    sp = SamplingParams(max_tokens=16, temperature=1.0)

    async def load(version: int, n: int) -> None:  # a few requests in flight during the swap
        async def one(i: int) -> None:
            rid = f"r{version}-{i}"
            v = await tracker.admit(rid)
            lora = adapters.request_for(v) if adapters is not None else None
            try:
                async for out in engine.generate(
                    {"prompt_token_ids": list(range(40, 72))}, sp, rid, lora_request=lora
                ):
                    tracker.on_output(rid, len(out.outputs[0].token_ids))
            finally:
                tracker.finish(rid)
                if adapters is not None:
                    await adapters.release(v)

        await asyncio.gather(*(one(i) for i in range(n)))

    out = []
    for ref in refs:
        work = asyncio.create_task(load(ref.version, 4))
        await asyncio.sleep(0.05)
        if adapters is None:
            rep = await barrier.swap(
                ref.version, partial(ft.apply, ref.version), prepare=partial(ft.stage, ref)
            )
        else:
            rep = await adapters.swap(ref, tracker)
        await work
        assert rep.ok, rep.error
        out.append(rep.timings)
    return out


def measure(model_dir: Path, rank: int, versions: int, adapter: bool, work: Path) -> dict:
    from pipeline.config import EngineConfig, ModelConfig, load_config
    from pipeline.learner.trainer import PolicyTrainer
    from pipeline.producer.adapters import AdapterSet
    from pipeline.producer.engine import build_engine
    from sync.lora import adapter_config
    from sync.snapshot import write_snapshot

    cfg = load_config(
        overrides={
            "model.path": str(model_dir),
            "data.path": "arithmetic:10",
            "run_dir": str(work),
            "rewards.specs": [{"fn": "pipeline.tasks.rewards:length_reward", "weight": 1.0}],
            "model.dtype": "bfloat16",
            "train.lora_rank": rank,
            "train.lora_alpha": 2.0 * rank,
            "sync.lora_adapters": "auto" if adapter else "off",
        }
    )
    tr = PolicyTrainer(cfg, str(model_dir), device="cpu")
    refs, sizes = [], []
    for v in range(1, versions + 1):
        with torch.no_grad():
            for n, p in tr.model.named_parameters():
                if "lora_B" in n:
                    p.add_(0.01)
        ref = write_snapshot(tr.snapshot_tensors(), v, work / ("a" if adapter else "m"))
        refs.append(ref)
        sizes.append(Path(ref.uri).stat().st_size)
    del tr

    async def run() -> list[dict[str, float]]:
        engine = build_engine(
            ModelConfig(dtype="bfloat16"),
            EngineConfig(max_model_len=512, cpu_kvcache_space_gib=1),
            str(model_dir),
            seed=0,
            lora_rank=rank if adapter else 0,
        )
        try:
            ad = (
                AdapterSet(
                    engine,
                    "lora-bench",
                    adapter_config(rank, 2.0 * rank, list(cfg.train.lora_target_modules)),
                )
                if adapter
                else None
            )
            return await _swaps(engine, refs, ad)
        finally:
            engine.shutdown()

    timings = asyncio.run(run())[1:]  # the first swap also pays one-off warm-ups

    def med(key: str) -> float:
        return statistics.median(t.get(key, 0.0) for t in timings)

    return {
        "path": "adapter" if adapter else "merged",
        "bytes_per_version": sizes[-1],
        "swap_total_s": med("total_s"),
        "prepare_s": med("prepare_s"),
        "engine_idle_s": med("idle_s"),
        "load_s": med("load_s"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="'tiny', 'smollm2-135m' or a HF directory")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--versions", type=int, default=3)
    args = ap.parse_args()
    from pipeline.models import resolve_model

    with tempfile.TemporaryDirectory() as d:
        model_dir = resolve_model(args.model, Path(tempfile.gettempdir()) / "pipeline-models")
        for adapter in (False, True):
            print(
                json.dumps(measure(model_dir, args.rank, args.versions, adapter, Path(d))),
                flush=True,
            )


if __name__ == "__main__":
    main()
