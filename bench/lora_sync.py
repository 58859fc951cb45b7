"""LoRA cost, adapter-only vs merged weights: bytes per version, swap time, and generation
throughput on one engine.

For each path: a LoRA PolicyTrainer (peft) gives a version's snapshot (``sync.lora_adapters``
on and merge: the adapter; off: the targeted weights merged), written as a snapshot file; a real
vLLM engine then swaps to it through the producer's own code (merged, and merge-on-producer,
whose workers merge the adapter as they load it: FileRoute in the sync barrier; adapter:
AdapterSet.swap, no pause) while requests run. Then the engine generates a
fixed batch on the last version (``--seqs`` requests of ``--gen-tokens`` tokens, ignore_eos,
best of ``--repeats`` after a warm-up): tokens/s with the adapter and with the merged weights,
and their ratio. The adapter engine also generates the batch without an adapter (base
weights, rounds interleaved with the adapter's), which separates the cost of serving an
adapter from that of an engine built with LoRA enabled.

    python -m bench.lora_sync --model smollm2-135m --rank 16 --versions 3
    python -m bench.lora_sync --model smollm2-135m --ops   # one layer's LoRA ops, no engine
    bash bench/run_gpu.sh lora    # GPU: the 0.5B model, 256 x 128 tokens, CUDA graphs
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch


async def _swaps(engine, refs, adapters) -> list[dict[str, float]]:
    from vllm import SamplingParams

    from sync.barrier import RequestTracker, SwapBarrier
    from sync.routes.file import FileRoute

    tracker = RequestTracker()
    barrier = SwapBarrier(engine, tracker)
    ft = FileRoute(engine)
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


async def generation_rates(engine, loras: dict[str, object], seqs: int, gen_tokens: int,
                           repeats: int) -> dict[str, float]:
    """Generated tokens/s of ``seqs`` concurrent requests of ``gen_tokens`` tokens each, for
    each named LoRARequest of ``loras`` (None: the engine's own weights); the best of
    ``repeats`` timed rounds after one warm-up round, the names' rounds interleaved so that
    a busy machine slows each alike."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(max_tokens=gen_tokens, temperature=1.0, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)

    async def one(rid: str, i: int, lora: object) -> int:
        n = 0
        prompt = [40 + (i + k) % 60 for k in range(32)]  # distinct prompts: no shared prefix
        async for out in engine.generate({"prompt_token_ids": prompt}, sp, rid,
                                         lora_request=lora):
            n = len(out.outputs[0].token_ids)
        return n

    best = dict.fromkeys(loras, 0.0)
    for r in range(repeats + 1):
        for name, lora in loras.items():
            t0 = time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(f"{name}-{r}-{i}", i, lora)
                                                for i in range(seqs))))
            if r:  # round 0 warms up (an adapter's first use, allocations)
                best[name] = max(best[name], tokens / (time.perf_counter() - t0))
    return best


PATHS = ("merged", "adapter", "merge-on-producer")


def measure(model_dir: Path, rank: int, versions: int, path: str, work: Path,
            seqs: int = 32, gen_tokens: int = 32, repeats: int = 2,
            cuda_graphs: bool = False) -> dict:
    """One path of ``PATHS``: merged weights shipped; the adapter served as a LoRARequest; the
    adapter shipped and merged into the engine's weights as it loads (``sync.lora_adapters``
    off, on, merge)."""
    adapter = path == "adapter"
    from pipeline.config import EngineConfig, ModelConfig, load_config
    from pipeline.launch.derive import resolve
    from pipeline.learner.trainer import PolicyTrainer
    from pipeline.producer.adapters import AdapterSet
    from pipeline.producer.engine import build_engine
    from sync.lora import adapter_config
    from sync.snapshot import write_snapshot

    cfg = resolve(load_config(
        overrides={
            "model.path": str(model_dir),
            "data.path": "arithmetic:10",
            "run_dir": str(work),
            "rewards.specs": [{"fn": "pipeline.tasks.rewards:length_reward", "weight": 1.0}],
            "model.dtype": "bfloat16",
            "train.lora_rank": rank,
            "train.lora_alpha": 2.0 * rank,
            "sync.lora_adapters": {"merged": "off", "adapter": "on"}.get(path, "merge"),
        }
    ))
    tr = PolicyTrainer(cfg, str(model_dir), device="cpu")
    refs, sizes = [], []
    for v in range(1, versions + 1):
        with torch.no_grad():
            for n, p in tr.model.named_parameters():
                if "lora_B" in n:
                    p.add_(0.01)
        ref = write_snapshot(tr.snapshot_tensors(), v, work / path)
        refs.append(ref)
        sizes.append(Path(ref.uri).stat().st_size)
    del tr

    rates: dict[str, float] = {}

    async def run() -> list[dict[str, float]]:
        engine = build_engine(
            ModelConfig(dtype="bfloat16"),
            EngineConfig(max_model_len=512, cpu_kvcache_space_gib=1,
                         enforce_eager=not cuda_graphs),
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
            if path == "merge-on-producer":
                await engine.collective_rpc("sync_lora_merge", args=(2.0,))  # alpha / rank
            timings = await _swaps(engine, refs, ad)
            # The last version: its adapter (and, on the same engine, the base weights
            # without one), or the merged weights.
            loras = ({"gen_tokens_per_s": ad.requests[refs[-1].version],
                      "gen_tokens_per_s_base": None} if ad is not None
                     else {"gen_tokens_per_s": None})
            rates.update(await generation_rates(engine, loras, seqs, gen_tokens, repeats))
            return timings
        finally:
            engine.shutdown()

    timings = asyncio.run(run())[1:]  # the first swap also pays one-off warm-ups
    gc.collect()  # the engine, now: its __del__ at interpreter exit would shut it down again

    def med(key: str) -> float:
        return statistics.median(t.get(key, 0.0) for t in timings)

    return {
        "path": path,
        "bytes_per_version": sizes[-1],
        "swap_total_s": med("total_s"),
        "prepare_s": med("prepare_s"),
        "engine_idle_s": med("idle_s"),
        "load_s": med("load_s"),
        **({"prepare_write_s": med("prepare_write_s"),
            "prepare_add_lora_s": med("prepare_add_lora_s")} if adapter else {}),
        **rates,
    }


def lora_ops(model_dir: Path, rank: int, token_counts: tuple[int, ...] = (32, 1024),
             repeats: int = 5) -> list[dict]:
    """One decoder layer's projections of ``model_dir``'s shapes, bf16, in this process (no
    engine): ms for the base weights' matmuls, for vLLM's torch LoRA ops as its CPU build runs
    them (``PunicaWrapperCPU``: shrink to fp32 buffers, expand into each output slice), and for
    the same adapter applied as two thin matmuls per slice (all tokens on one adapter); the
    best of ``repeats``. Tells whether an adapter's cost is vLLM's kernels."""
    from vllm.lora.ops.torch_ops import sgmv_expand_slice, sgmv_shrink

    c = json.loads((model_dir / "config.json").read_text())
    h, inter = c["hidden_size"], c["intermediate_size"]
    kv = c.get("num_key_value_heads", c["num_attention_heads"]) * (h // c["num_attention_heads"])
    mods = {"qkv": (h, [h, kv, kv]), "o": (h, [h]), "gate_up": (h, [inter, inter]),
            "down": (inter, [h])}
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    a = {n: [rand(2, 1, rank, d) for _ in outs] for n, (d, outs) in mods.items()}
    b = {n: [rand(2, 1, o, rank) for o in outs] for n, (d, outs) in mods.items()}
    w = {n: rand(sum(outs), d) for n, (d, outs) in mods.items()}

    def base(x: dict) -> None:
        for n, (d, _outs) in mods.items():
            x[d] @ w[n].T

    def vllm_ops(x: dict) -> None:
        n_tok = x[h].shape[0]
        start, lens, idx = torch.tensor([0]), torch.tensor([n_tok]), torch.tensor([1])
        for n, (d, outs) in mods.items():
            buf = [torch.zeros(n_tok, rank) for _ in outs]
            y = torch.zeros(n_tok, sum(outs), dtype=torch.bfloat16)
            for k in range(len(outs)):
                sgmv_shrink(x[d], a[n][k], buf[k], start, lens, idx, 1, n_tok, n_tok, 1.0)
            off = 0
            for k, o in enumerate(outs):
                sgmv_expand_slice(buf[k], b[n][k], y, start, lens, idx, 1, n_tok, n_tok, off, o,
                                  True)
                off += o

    def grouped(x: dict) -> None:
        for n, (d, outs) in mods.items():
            y = torch.zeros(x[h].shape[0], sum(outs), dtype=torch.bfloat16)
            off = 0
            for k, o in enumerate(outs):
                y[:, off:off + o] += (x[d] @ a[n][k][1, 0].T) @ b[n][k][1, 0].T
                off += o

    rows = []
    for n_tok in token_counts:
        x = {h: rand(n_tok, h), inter: rand(n_tok, inter)}
        row: dict = {"tokens": n_tok}
        for name, fn in (("base_ms", base), ("vllm_lora_ms", vllm_ops),
                         ("grouped_lora_ms", grouped)):
            fn(x)
            best = math.inf
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn(x)
                best = min(best, time.perf_counter() - t0)
            row[name] = best * 1e3
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="'tiny', 'smollm2-135m' or a HF directory")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--seqs", type=int, default=32, help="concurrent requests per round")
    ap.add_argument("--gen-tokens", type=int, default=32, help="tokens each request generates")
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds (best kept)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="engine.enforce_eager=false (GPU: CUDA graphs, as training runs use)")
    ap.add_argument("--paths", default=",".join(PATHS),
                    help=f"comma-separated, of {', '.join(PATHS)} (merged always runs: the "
                         "ratios are against it)")
    ap.add_argument("--ops", action="store_true",
                    help="only time one decoder layer's LoRA ops on CPU (vLLM's torch ops vs "
                         "two matmuls per slice vs the base matmuls), no engine")
    args = ap.parse_args()
    from pipeline.models import resolve_model

    if args.ops:
        model_dir = resolve_model(args.model, Path(tempfile.gettempdir()) / "pipeline-models")
        for row in lora_ops(model_dir, args.rank):
            print(json.dumps(row), flush=True)
        return

    with tempfile.TemporaryDirectory() as d:
        model_dir = resolve_model(args.model, Path(tempfile.gettempdir()) / "pipeline-models")
        wanted = [p for p in PATHS if p == "merged" or p in args.paths.split(",")]
        rows = {}
        for path in wanted:
            rows[path] = measure(model_dir, args.rank, args.versions, path, Path(d),
                                 args.seqs, args.gen_tokens, args.repeats, args.cuda_graphs)
            print(json.dumps(rows[path]), flush=True)
        merged, ad, mp = rows["merged"], rows.get("adapter"), rows.get("merge-on-producer")
        ratios = {}
        if ad is not None:
            ratios["adapter_over_merged_gen"] = ad["gen_tokens_per_s"] / merged["gen_tokens_per_s"]
            ratios["adapter_engine_base_over_merged_gen"] = \
                ad["gen_tokens_per_s_base"] / merged["gen_tokens_per_s"]
        if mp is not None:
            ratios["merge_on_producer_over_merged_gen"] = \
                mp["gen_tokens_per_s"] / merged["gen_tokens_per_s"]
            ratios["merge_on_producer_bytes_over_merged"] = \
                mp["bytes_per_version"] / merged["bytes_per_version"]
        print(json.dumps(ratios), flush=True)


if __name__ == "__main__":
    main()
