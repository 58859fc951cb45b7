"""Async vs sync (vs TRL's GRPOTrainer): the same GRPO job on the same GPUs, measured in one run.

    python -m bench.gpu_bench --layout split --model 0.5b --steps 12 --out runs/bench \\
        --runs sync,async1,async2 [--trl colocate,server,async]
    python -m bench.gpu_bench --layout colocated --task reward --model /tmp/smollm2 \\
        --runs sync,async1 --max-tokens 16 --lr 5e-5 --set data.path=arithmetic:2000:9 ...

Every run trains the same model on the same prompts (synthetic arithmetic, exact-match reward)
with the same batch (``--batch-groups`` prompts x ``--group-size`` completions of exactly
``--max-tokens`` tokens, ``ignore_eos``) for the same number of learner steps; only the mode
differs. ``--task reward`` is the reward-vs-wall-clock variant for a real model: completions stop
at EOS (``--max-tokens`` is only a cap), and the report adds each run's time to reach a common
reward level (see ``reward_threshold``); TRL runs are not offered there.

Layouts: ``split`` = producer on GPU 0, learner on GPU 1; ``split-shared`` = producers on GPUs 0
and 1, learner on GPU 1; ``split-3x1`` = producers on GPUs 0-2, learner on GPU 3; ``split-tp2`` =
one producer with tensor parallelism over GPUs 0 and 1, learner on GPU 2; ``colocated`` = both on
GPU 0 (the engine gets ``--gpu-mem`` of it); ``colocated-2`` = a producer on each of GPUs 0
and 1, the learner sharded over both (FSDP2, packed and checkpointed micro-batches: the 7B
path; engine share 0.15). ``--gpus`` says which of the machine's GPUs the
layout's 0, 1, ... are, so two layouts can run side by side on disjoint GPUs of one machine.
A run named ``ray-<mode>`` is ``<mode>`` started with ``--launcher ray`` on a private Ray node
that sees only the layout's GPUs; Ray picks which GPU each actor gets, so its busy columns are
n/a. Figures are taken over the steady window
(after ``--warmup-steps``), so engine start and the first batch are not counted:
- trained samples/s and completion tokens/s, wall time per step;
- busy fraction of each GPU role (NVML utilization sampled every 0.1 s: the fraction of time a
  kernel ran), i.e. how much of the time generation and training actually use their GPU;
- weight-sync time per step (learner publish -> all acks) and engine idle per swap;
- the staleness distribution of trained groups;
- MFU where the run logs it per step (``mfu``, ``mfu_compute``: fractions of the GPU's dense
  bf16 peak): TRL's async trainer does (``perf/mfu_wall_clock``: whole step; ``perf/mfu_fwd_bwd``:
  forward + backward only), read by bench/trl_async.py.
TRL runs (``--trl``): ``colocate`` and ``server`` are TRL's GRPOTrainer (bench/trl_grpo.py);
``async`` is TRL's AsyncGRPOTrainer (bench/trl_async.py, split layout only: its vLLM server on
the generation GPU, its trainer on the learner GPU, max_staleness 1 like our async1).
It writes ``results.json``, ``results.md`` (a Markdown table with the async/sync and ours/TRL
ratios) and ``results.png`` into ``--out``, after every run (a bench cut by SIGTERM keeps the
runs it finished). Runs without GPUs too (tiny model on the CPU build),
which is how its own test exercises it; GPU busy fractions are then reported as n/a.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.procs import wait_group_gone

RUNS = {  # name -> (train.mode, max_staleness, extra options)
    "sync": ("sync", 0, ()),
    # sync with the engine asleep while the learner trains (colocated memory, at its cost)
    "sync-sleep": ("sync", 0, ("engine.sleep_when_idle=true",)),
    "async1": ("async", 1, ()),
    "async2": ("async", 2, ()),
}
LAYOUTS = {  # name -> (producer_gpus, one producer per entry; learner_gpus; GPUs per role)
    "split": (["0"], "1", {"generation": [0], "learner": [1]}),
    "colocated": (["0"], "0", {"generation": [0], "learner": [0]}),
    # 2 GPUs for a generation-bound job: a second producer shares the learner's GPU.
    "split-shared": (["0", "1"], "1", {"generation": [0, 1], "learner": [1]}),
    # 4 GPUs: 3 producer GPUs + 1 learner GPU (scaling of generation).
    "split-3x1": (["0", "1", "2"], "3", {"generation": [0, 1, 2], "learner": [3]}),
    # 3 GPUs: one producer whose engine is tensor-parallel over GPUs 0 and 1.
    "split-tp2": (["0,1"], "2", {"generation": [0, 1], "learner": [2]}),
    # 2 GPUs (7B): a producer on each GPU, the learner sharded over both (one rank a GPU).
    "colocated-2": (["0", "1"], "0,1", {"generation": [0, 1], "learner": [0, 1]}),
    "cpu": ([], "", {}),
}
# The sharded learner of a layout with several learner GPUs, unless --set names the key: FSDP2
# with packed, checkpointed micro-batches of 8k tokens (BENCHMARKS.md, "The learner alone, 7B":
# FSDP2 is 36% MFU at 16k alone, ZeRO-3 at 4 rows 7.7%). Beside the engines 8k rather than 16k:
# GPU 0, which also holds the buffers rank 0 publishes versions from, peaked at 90% of an H200
# with 8k and engines at 0.15 (7% fewer samples/s than 16k, which left no room). --set
# train.accelerate_config=... runs ZeRO-3 instead, with the same micro-batches.
SHARDED_LEARNER = ("train.fsdp2=true", "train.packing=true", "train.micro_batch_tokens=8192",
                   "train.gradient_checkpointing=true")
# Engine share per layout when --gpu-mem is not given: at 7B an engine needs 14.3 GiB of weights
# and a few of KV cache for the job's 128 sequences, so 0.15 of a 143.8 GB H200; other layouts
# 0.5.
GPU_MEM = {"colocated-2": 0.15}


@dataclass
class RunResult:
    name: str
    ok: bool
    wall_s: float
    steps: int = 0
    window_steps: int = 0
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    step_s_median: float | None = None
    sync_s_mean: float | None = None
    swap_idle_s_mean: float | None = None
    transport_fallbacks: int = 0  # GPU weight swaps that fell back to the file (ours)
    staleness: dict = field(default_factory=dict)
    # runs that log no histogram (TRL async): the window's mean of per-step means, and max
    staleness_mean: float | None = None
    staleness_max: float | None = None
    mfu: float | None = None          # median per-step MFU over the window (whole step)
    mfu_compute: float | None = None  # the same over forward + backward time only (TRL async)
    gpu_busy: dict = field(default_factory=dict)
    # GB of each GPU in use at its highest over the whole run (NVML, every process on it: the
    # engines' share and the learner's peak together; results.json only)
    gpu_mem_peak_gb: dict = field(default_factory=dict)
    # ours: the memory plan's prediction (run_dir/memory_plan.json: the learner's peak and the
    # whole card's, engines included) and the learner's measured peak (the allocator's reserved
    # bytes at their highest over the steps, metric mem_peak_gb), GB; the card's size
    plan_peak_gb: float | None = None
    plan_learner_gb: float | None = None
    learner_peak_gb: float | None = None
    card_gb: float | None = None
    plan: str = ""
    oom_retries: int = 0
    # GPUs in both roles (colocated, split-shared): their busy fraction is in both busy columns
    shared_gpus: list = field(default_factory=list)
    reward_curve: list = field(default_factory=list)  # [(seconds since first step, reward)]
    # --task reward: when the trailing --reward-window mean reward first reached the common level
    time_to_reward_s: float | None = None  # seconds since the run's first step
    steps_to_reward: int | None = None
    note: str = ""


def _nvml_handles() -> tuple[Any, list]:
    """(pynvml, a handle per visible GPU), or (None, []) where there is no NVIDIA driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml, [pynvml.nvmlDeviceGetHandleByIndex(i)
                        for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:
        return None, []


class GpuSampler:
    """NVML utilization of every visible GPU every ``period`` s, in a daemon thread."""

    def __init__(self, period: float = 0.1):
        self.period = period
        self.samples: list[tuple[float, list[int]]] = []
        self.mem_peak: dict[int, float] = {}  # GPU -> the most bytes in use seen
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # No NVIDIA driver (CPU machines): no handles, busy fractions are n/a.
        self._nvml, self._handles = _nvml_handles()

    def __enter__(self) -> GpuSampler:
        if self._handles:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            util = [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
            self.samples.append((time.time(), util))
            for i, h in enumerate(self._handles):
                used = float(self._nvml.nvmlDeviceGetMemoryInfo(h).used)
                self.mem_peak[i] = max(self.mem_peak.get(i, 0.0), used)

    def busy(self, gpu: int, t0: float, t1: float) -> float | None:
        vals = [u[gpu] for ts, u in self.samples if t0 <= ts <= t1 and gpu < len(u)]
        return round(statistics.fmean(vals) / 100.0, 3) if vals else None


def summarize(name: str, metrics: list[dict], wall_s: float, warmup: int,
              batch_samples: int, sampler: GpuSampler | None, roles: dict) -> RunResult:
    """Steady-window figures of one run from its metrics.jsonl rows (pure; unit-tested)."""
    res = RunResult(name=name, ok=bool(metrics), wall_s=round(wall_s, 1), steps=len(metrics))
    if len(metrics) <= warmup + 1:
        res.ok = False
        res.note = f"only {len(metrics)} steps logged (need > {warmup + 1})"
        return res
    window = metrics[warmup + 1:]
    t0, t1 = metrics[warmup]["ts"], metrics[-1]["ts"]
    span = max(t1 - t0, 1e-9)
    res.window_steps = len(window)
    res.samples_per_s = round(len(window) * batch_samples / span, 2)
    res.tokens_per_s = round(sum(m.get("trained_tokens", 0.0) for m in window) / span, 1)
    res.step_s_median = round(statistics.median(m["step_s"] for m in window), 3)
    syncs = [m["sync_s"] for m in window if "sync_s" in m]
    res.sync_s_mean = round(statistics.fmean(syncs), 3) if syncs else None
    idles = [m["swap_idle_s"] for m in window if "swap_idle_s" in m]
    res.swap_idle_s_mean = round(statistics.fmean(idles), 3) if idles else None
    res.transport_fallbacks = int(max(m.get("transport_fallbacks", 0) for m in metrics))
    hist: dict[str, float] = {}
    for m in window:
        for k, v in m.items():
            if k.startswith("staleness_hist/"):
                key = k.split("/", 1)[1]
                hist[key] = hist.get(key, 0.0) + float(v)
    res.staleness = dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
    means = [m["staleness_mean"] for m in window if "staleness_mean" in m]
    if means:
        res.staleness_mean = round(statistics.fmean(means), 3)
        res.staleness_max = max(m.get("staleness_max", 0.0) for m in window)
    for key in ("mfu", "mfu_compute"):
        vals = [m[key] for m in window if m.get(key) is not None]
        setattr(res, key, round(statistics.median(vals), 4) if vals else None)
    if sampler is not None:
        for role, gpus in roles.items():
            vals = [sampler.busy(g, t0, t1) for g in gpus]
            res.gpu_busy[role] = (round(statistics.fmean(vals), 3)
                                  if vals and None not in vals else None)
        res.shared_gpus = sorted(set(roles.get("generation", [])) & set(roles.get("learner", [])))
        peaks = getattr(sampler, "mem_peak", {})
        res.gpu_mem_peak_gb = {str(g): round(peaks[g] / 1e9, 1)
                               for g in sorted({g for gs in roles.values() for g in gs})
                               if g in peaks}
    peaks = [m["mem_peak_gb"] for m in metrics if m.get("mem_peak_gb") is not None]
    res.learner_peak_gb = round(max(peaks), 1) if peaks else None
    res.oom_retries = int(sum(m.get("oom_retries", 0.0) for m in metrics))
    first = metrics[0]["ts"]
    res.reward_curve = [(round(m["ts"] - first, 2), round(m.get("reward_mean", 0.0), 4))
                        for m in metrics]
    return res


def smoothed(curve: list, window: int) -> list[tuple[float, float]]:
    """(t, mean of this reward and the ``window - 1`` before it) for each point of ``curve`` with
    a full window behind it. Per-step rewards of one batch are noisy (128 samples: +-0.04), so
    levels are read from this trailing mean, never from a single lucky step."""
    return [(curve[i][0], statistics.fmean(r for _, r in curve[i - window + 1:i + 1]))
            for i in range(window - 1, len(curve))]


def time_to_reward(curve: list, threshold: float, window: int) -> tuple[float, int] | None:
    """(seconds, step) at which the trailing ``window``-step mean reward first reaches
    ``threshold``; None if it never does. Steps count from 1, one curve point per step."""
    for i, (t, r) in enumerate(smoothed(curve, window)):
        if r >= threshold - 1e-9:
            return t, i + window
    return None


def reward_threshold(curves: list[list], window: int, frac: float) -> dict | None:
    """The common reward level the runs are timed to: ``start + frac * (peak - start)``, where
    ``start`` is the mean of the runs' first trailing means and ``peak`` the highest trailing
    mean that *every* run reaches (the lowest of their maxima). Measured from the start, so a
    model that begins at 0.6 is not credited with reaching 0.5. None if no curve has a window."""
    sm = [smoothed(c, window) for c in curves]
    sm = [s for s in sm if s]
    if not sm:
        return None
    start = statistics.fmean(s[0][1] for s in sm)
    peak = min(max(r for _, r in s) for s in sm)
    # min(): if the reward fell (peak < start), the level is the peak, which every run reaches.
    return {"threshold": min(start + frac * (peak - start), peak), "start": start, "peak": peak,
            "window": window, "frac": frac}


def mark_time_to_reward(results: list[RunResult], window: int, frac: float,
                        threshold: float | None = None) -> dict | None:
    """Set each result's time/steps to the common level (``threshold`` if given, else
    ``reward_threshold`` over all runs with a curve); returns the level's description."""
    info = (reward_threshold([r.reward_curve for r in results], window, frac)
            if threshold is None else
            {"threshold": threshold, "start": None, "peak": None, "window": window, "frac": None})
    if info is None:
        return None
    for r in results:
        hit = time_to_reward(r.reward_curve, info["threshold"], window)
        r.time_to_reward_s, r.steps_to_reward = (round(hit[0], 2), hit[1]) if hit else (None, None)
    return info


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def physical(args: argparse.Namespace, spec: str) -> str:
    """A layout's GPU list ("0", "0,1") as the machine's GPU ids (``--gpus``)."""
    ids = args.gpus.split(",") if args.gpus else None
    return ",".join(ids[int(g)] if ids else g for g in spec.split(",")) if spec else spec


def physical_roles(args: argparse.Namespace, roles: dict) -> dict:
    return {role: [int(physical(args, str(g))) for g in gpus] for role, gpus in roles.items()}


def run_ours(args: argparse.Namespace, name: str, model: str, out: Path) -> RunResult:
    on_ray = name.startswith("ray-")
    mode, staleness, extra = RUNS[name.removeprefix("ray-")]
    producer_gpus, learner_gpus, roles = LAYOUTS[args.layout]
    tp = len(producer_gpus[0].split(",")) if producer_gpus else 1
    run_dir = out / name
    cmd = [sys.executable, "-m", "pipeline.launch.cli", "--config", str(args.config),
           "--name", f"bench-{name}", "--run_dir", str(run_dir), "--model.path", model,
           "--train.mode", mode, "--train.max_staleness", str(staleness),
           "--train.steps", str(args.steps), "--train.batch_groups", str(args.batch_groups),
           "--generation.group_size", str(args.group_size),
           "--generation.max_tokens", str(args.max_tokens),
           *(["--generation.ignore_eos"] if args.task == "throughput" else []),
           "--train.lr", _yaml_float(args.lr), "--engine.gpu_memory_utilization", str(args.gpu_mem),
           "--num_producers", str(max(len(producer_gpus), 1)), "--tensorboard", "false",
           *(["--engine.tensor_parallel_size", str(tp)] if tp > 1 else [])]
    ranks = len(learner_gpus.split(",")) if learner_gpus else 1
    if ranks > 1:  # a sharded learner, one rank a GPU (SHARDED_LEARNER unless --set says)
        cmd += ["--train.learner_processes", str(ranks)]
        sets = dict(kv.partition("=")[::2] for kv in (*extra, *args.set))
        zero = "train.accelerate_config" in sets  # a DeepSpeed config of the user's
        cmd += [a for kv in SHARDED_LEARNER if kv.partition("=")[0] not in sets
                and not (zero and kv.startswith("train.fsdp2=")) for a in ("--set", kv)]
        fsdp2 = sets.get("train.fsdp2", "true").strip().lower() in ("true", "1", "yes", "on")
        if not zero and not fsdp2:  # --set train.fsdp2=false: ZeRO-3 in DeepSpeed's bf16 mode
            cmd += ["--train.accelerate_config",
                    str(Path(__file__).resolve().parents[1] / "examples/accelerate/zero3.yaml")]
    env = None
    if on_ray:  # Ray assigns the GPUs: its node sees the layout's, each actor asks for its share
        gpus = sorted({g for spec in [*producer_gpus, learner_gpus] for g in spec.split(",") if g})
        env = os.environ | {"CUDA_VISIBLE_DEVICES": physical(args, ",".join(gpus))}
        cmd += ["--launcher", "ray", "--set", f"launch.learner_num_gpus={1 if gpus else 0}",
                "--set", f"launch.producer_num_gpus={tp if gpus else 0}"]
        roles = {}
    else:
        cmd += ["--producer_gpus", json.dumps([physical(args, g) for g in producer_gpus]),
                "--learner_gpus", physical(args, learner_gpus)]
        roles = physical_roles(args, roles)
    for kv in (*extra, *args.set):
        cmd += ["--set", kv]
    res = _timed(args, name, cmd, run_dir / "metrics.jsonl", roles, out / f"{name}.log", env=env)
    return with_plan(res, run_dir / "memory_plan.json")


def with_plan(res: RunResult, path: Path) -> RunResult:
    """``res`` with the memory plan's prediction from the run's memory_plan.json, if any."""
    try:
        plan = json.loads(path.read_text())
    except (OSError, ValueError):
        return res
    res.plan_peak_gb = round(plan["peak"] / 1e9, 1)
    res.plan_learner_gb = round(plan["learner"] / 1e9, 1)
    res.card_gb = round(plan["card"] / 1e9, 1)
    res.plan = plan.get("line", "")
    return res


def _yaml_float(x: float) -> str:
    """``x`` as text that YAML reads back as a float (pipeline.launch.cli parses option values
    as YAML, and PyYAML takes "5e-05", without a dot, for a string)."""
    text = repr(float(x))
    mantissa, e, exp = text.partition("e")
    return f"{mantissa}.0e{exp}" if e and "." not in mantissa else text


def run_trl(args: argparse.Namespace, name: str, model: str, out: Path) -> RunResult:
    """TRL's GRPOTrainer through bench/trl_grpo.py (same model, prompts, reward, batch); TRL's
    AsyncGRPOTrainer through bench/trl_async.py for ``trl-async``."""
    vllm_mode = name.removeprefix("trl-")
    if vllm_mode == "async":
        return run_trl_async(args, name, model, out)
    steps_json = out / f"{name}.json"
    cmd = [sys.executable, "-m", "bench.trl_grpo", "--model", model, "--vllm-mode", vllm_mode,
           "--steps", str(args.steps), "--batch-groups", str(args.batch_groups),
           "--group-size", str(args.group_size), "--max-tokens", str(args.max_tokens),
           "--ignore-eos", "--lr", str(args.lr), "--out", str(steps_json),
           "--num-prompts", "4000", "--max-operand", "99",  # bench.yaml's arithmetic:4000:99
           *args.trl_arg]
    # colocate: trainer and vLLM on GPU 0; server: trainer on GPU 0, vLLM server on GPU 1.
    roles = {"generation": [0], "learner": [0]} if vllm_mode == "colocate" else (
        {"generation": [1], "learner": [0]})
    if args.layout == "cpu":
        roles = {}
    else:  # a trainer that sees both GPUs gets n_gpu=2, which GRPOTrainer refuses (DataParallel)
        cmd += ["--trainer-gpus", physical(args, "0"),
                *(["--server-gpus", physical(args, "1")] if vllm_mode == "server" else [])]
        roles = physical_roles(args, roles)
    return _timed(args, name, cmd, steps_json, roles, out / f"{name}.log", trl=True)


def trl_async_command(args: argparse.Namespace, model: str, steps_json: Path) -> list[str]:
    """bench/trl_async.py on our job: its vLLM server on the split layout's generation GPU, its
    trainer on the learner GPU, max_staleness 1 (our async1)."""
    return [sys.executable, "-m", "bench.trl_async", "--model", model,
            "--steps", str(args.steps), "--batch-groups", str(args.batch_groups),
            "--group-size", str(args.group_size), "--max-tokens", str(args.max_tokens),
            "--ignore-eos", "--lr", str(args.lr), "--max-staleness", "1",
            "--out", str(steps_json), "--num-prompts", "4000", "--max-operand", "99",
            "--server-gpus", physical(args, LAYOUTS["split"][0][0]),
            "--trainer-gpus", physical(args, LAYOUTS["split"][1])]


def run_trl_async(args: argparse.Namespace, name: str, model: str, out: Path) -> RunResult:
    steps_json = out / f"{name}.json"
    roles = physical_roles(args, LAYOUTS["split"][2])
    res = _timed(args, name, trl_async_command(args, model, steps_json), steps_json, roles,
                 out / f"{name}.log", trl=True)
    # TRL admits generation by concurrency only (max_inflight_tasks), buffers up to its
    # queue_maxsize and drops what is too stale when the trainer takes it: say how much.
    dropped = _trl_dropped_stale(steps_json)
    if dropped:
        res.note = f"{res.note} TRL dropped {dropped} stale samples".strip()
    return res


def _trl_dropped_stale(path: Path) -> int:
    try:
        return int(json.loads(path.read_text()).get("dropped_stale") or 0)
    except (OSError, ValueError):
        return 0


def _timed(args: argparse.Namespace, name: str, cmd: list[str], metrics_path: Path,
           roles: dict, log_path: Path, trl: bool = False,
           env: dict[str, str] | None = None) -> RunResult:
    print(f"[bench] {name}: {' '.join(cmd)}", flush=True)
    mine = {int(g) for g in args.gpus.split(",")} if args.gpus else None
    busy = wait_gpus_free(only=mine)
    if busy:
        print(f"[bench] {name}: GPU memory still in use before the run: {busy}", flush=True)
    t0 = time.time()
    with GpuSampler() as sampler, open(log_path, "w") as log:
        code = run_group(cmd, log, args.run_timeout, env=env)
    wall = time.time() - t0
    rows = _trl_rows(metrics_path) if trl else _read_jsonl(metrics_path)
    res = summarize(name, rows, wall, args.warmup_steps, args.batch_groups * args.group_size,
                    sampler if sampler.samples else None, roles)
    if code != 0:
        res.ok = False
        tail = log_path.read_text().splitlines()[-5:] if log_path.exists() else []
        res.note = f"exit {code}: " + " / ".join(tail)[-400:]
    print(f"[bench] {name}: {json.dumps(asdict(res) | {'reward_curve': '...'})}", flush=True)
    return res


def wait_gpus_free(timeout: float = 60.0, max_used_gib: float = 2.0,
                   only: set[int] | None = None) -> dict[int, float]:
    """Wait until every GPU (of ``only``, when given) holds at most ``max_used_gib`` (the
    previous run's processes have released theirs); returns {gpu: GiB used} of those still above
    it (empty: all free, or no NVML). Each run then starts on empty GPUs, as the ones before it
    did."""
    pynvml, handles = _nvml_handles()
    if not handles:  # no NVIDIA driver: nothing to wait for
        return {}
    deadline = time.monotonic() + timeout
    while True:
        used = {i: pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**30 for i, h in enumerate(handles)
                if only is None or i in only}
        busy = {i: round(u, 1) for i, u in used.items() if u > max_used_gib}
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(1.0)


def run_group(cmd: list[str], log: Any, timeout: float, grace: float = 30.0,
              interrupted_grace: float = 10.0, env: dict[str, str] | None = None) -> int:
    """Run ``cmd`` in its own process group; past ``timeout``, SIGTERM the group (our launcher
    then stops its learner and engines cleanly), and SIGKILL whatever is left after ``grace``.
    Killing only the top process would leave its engines holding GPU memory for the next run
    (a TRL vLLM server once failed to start behind a timed-out run). Returns -1 on timeout.
    If this process is itself stopped (SIGTERM -> SystemExit, see ``main``), the group gets the
    same SIGTERM and ``interrupted_grace`` s: our launcher's engines and TRL's vLLM server sit in
    process groups of their own, which only their parent's clean stop reaches."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=env)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop_group(proc, grace)
        return -1
    except BaseException:
        _stop_group(proc, interrupted_grace)
        raise
    finally:
        _signal_group(proc.pid, signal.SIGKILL)  # children left by a run that exited, too
        proc.wait()
        # SIGKILL is delivered asynchronously: return only once the group is gone, so the next
        # run never meets an engine of this one still holding its GPU memory.
        wait_group_gone(proc.pid)


def _stop_group(proc: subprocess.Popen, grace: float) -> None:
    _signal_group(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _trl_rows(path: Path) -> list[dict]:
    """bench/trl_grpo.py's JSON as metrics rows ({ts, step_s, trained_tokens, reward_mean})."""
    if not path.exists():
        return []
    rows = json.loads(path.read_text()).get("steps", [])
    return [{k: v for k, v in r.items() if v is not None} for r in rows]


def write_report(out: Path, results: list[RunResult], args: argparse.Namespace,
                 device: str, reward: dict | None = None) -> str:
    """results.{md,json,png}; ``reward`` (from ``mark_time_to_reward``) adds the time-to-reward
    column, line and chart marks (--task reward)."""
    by = {r.name: r for r in results}

    def ratio(a: str, b: str) -> str:
        ra, rb = by.get(a), by.get(b)
        if ra and rb and ra.ok and rb.ok and ra.samples_per_s and rb.samples_per_s:
            return f"{ra.samples_per_s / rb.samples_per_s:.2f}x"
        return "n/a"

    def fmt(v: Any) -> str:
        return "n/a" if v is None else str(v)

    def busy(r: RunResult, role: str) -> str:
        v = r.gpu_busy.get(role)
        return fmt(v) + ("*" if v is not None and r.shared_gpus else "")

    length = (f"{args.max_tokens} tokens" if args.task == "throughput"
              else f"up to {args.max_tokens} tokens (stopping at EOS)")
    lines = [f"Device: {device}; layout {args.layout}; model {args.model}; "
             f"{args.batch_groups} prompts x {args.group_size} completions x "
             f"{length} per step; {args.steps} steps, "
             f"steady window after {args.warmup_steps} warm-up steps.", "",
             "| run | samples/s | tokens/s | s/step | gen GPU busy | learner GPU busy | "
             "sync s/step | engine idle s/swap | staleness (count) | MFU (step; fwd+bwd) | "
             + ("s to reward (step) | " if reward else "") + "note |",
             "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if reward else "")]
    for r in results:
        lines.append(
            f"| {r.name} | {fmt(r.samples_per_s)} | {fmt(r.tokens_per_s)} | "
            f"{fmt(r.step_s_median)} | {busy(r, 'generation')} | "
            f"{busy(r, 'learner')} | {fmt(r.sync_s_mean)} | "
            f"{fmt(r.swap_idle_s_mean)} | "
            f"{_staleness_cell(r)} | {_mfu_cell(r)} | "
            + (f"{_reward_cell(r)} | " if reward else "")
            + f"{'' if r.ok else 'FAILED '}{r.note}{_fallback_note(r)} |")
    lines += ["", "Ratios (trained samples/s): " + ", ".join(
        f"{a}/{b} = {ratio(a, b)}" for a, b in
        [("async1", "sync"), ("async2", "sync"), ("async1", "trl-colocate"),
         ("async1", "trl-server"), ("async1", "trl-async"), ("sync", "trl-colocate"),
         ("sync-sleep", "sync"),
         ("ray-async1", "async1"), ("ray-sync", "sync")]
        if a in by and b in by)]
    shared = _shared_gpu_note(results)
    if shared:
        lines += ["", shared]
    if reward:
        lines += ["", _reward_line(results, reward)]
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(
        {"device": device, "args": {k: str(v) for k, v in vars(args).items()},
         **({"reward_level": reward} if reward else {}),
         "results": [asdict(r) for r in results]}, indent=1))
    _plot(out / "results.png", results, reward)
    return text


def _shared_gpu_note(results: list[RunResult]) -> str:
    """The footnote of busy figures marked '*': a GPU that runs both generation and training
    is counted in both columns, so they overlap and say nothing about which role kept it busy."""
    by_gpus: dict[tuple, list[str]] = {}
    for r in results:
        if r.shared_gpus and any(v is not None for v in r.gpu_busy.values()):
            by_gpus.setdefault(tuple(r.shared_gpus), []).append(r.name)
    if not by_gpus:
        return ""
    runs = "; ".join(f"GPU {', '.join(map(str, g))} in {', '.join(names)}"
                     for g, names in by_gpus.items())
    return ("\\* Busy on a GPU that runs both a producer and the learner (" + runs + "): its "
            "fraction is in both busy columns (gen GPU busy is the mean over the generation "
            "GPUs), so the two columns overlap and do not split its time between the roles.")


def _staleness_cell(r: RunResult) -> str:
    if r.staleness:
        return ", ".join(f"{k}: {int(v)}" for k, v in r.staleness.items())
    if r.staleness_mean is not None:  # TRL async logs a per-step mean and max, no histogram
        return f"mean {r.staleness_mean}, max {int(r.staleness_max or 0)}"
    return "n/a"


def _mfu_cell(r: RunResult) -> str:
    if r.mfu is None and r.mfu_compute is None:
        return "n/a"
    pct = ["n/a" if v is None else f"{100 * v:.1f}%" for v in (r.mfu, r.mfu_compute)]
    return pct[0] if r.mfu_compute is None else f"{pct[0]}; {pct[1]}"


def _reward_cell(r: RunResult) -> str:
    if r.time_to_reward_s is None:
        return "not reached"
    return f"{r.time_to_reward_s} ({r.steps_to_reward})"


def _reward_line(results: list[RunResult], info: dict) -> str:
    """One sentence: the level, how it was chosen, each run's time to it, and the ratio to sync."""
    if info.get("start") is None:
        how = "given by --reward-threshold"
    elif info["peak"] <= info["start"] + 1e-9:
        how = (f"the highest {info['window']}-step mean every run reaches; the reward did not "
               f"rise from {info['start']:.3f}, so these times mean nothing")
    else:
        how = (f"{info['start']:.3f} + {info['frac']} x ({info['peak']:.3f} - "
               f"{info['start']:.3f}): {info['frac']:.0%} of the way from the runs' first "
               f"{info['window']}-step mean to the highest one every run reaches")
    times = ", ".join(
        f"{r.name} {r.time_to_reward_s} s (step {r.steps_to_reward})"
        if r.time_to_reward_s is not None else f"{r.name} not reached" for r in results)
    by = {r.name: r for r in results}
    base = by.get("sync")
    ratios = ", ".join(
        f"sync/{r.name} = {base.time_to_reward_s / r.time_to_reward_s:.2f}x"
        for r in results if r.name != "sync" and base and base.time_to_reward_s is not None
        and r.time_to_reward_s)
    return (f"Time to a {info['window']}-step mean reward >= {info['threshold']:.3f} ({how}), "
            f"from each run's first step: {times}."
            + (f" Time ratio {ratios}." if ratios else ""))


def _fallback_note(r: RunResult) -> str:
    return f" {r.transport_fallbacks} swaps fell back to file" if r.transport_fallbacks else ""


def _plot(path: Path, results: list[RunResult], reward: dict | None = None) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    ax_bar, ax_rew = fig.subplots(1, 2)
    names = [r.name for r in results]
    ax_bar.bar(names, [r.samples_per_s or 0.0 for r in results], color="tab:blue")
    ax_bar.set_ylabel("trained samples/s (steady)")
    ax_bar.set_title("throughput")
    for r in results:
        if not r.reward_curve:
            continue
        xs, ys = zip(*r.reward_curve, strict=True)
        if reward is None:
            ax_rew.plot(xs, ys, marker=".", label=r.name)
            continue
        # --task reward: raw per-step rewards faint, the trailing mean that is timed solid.
        (line,) = ax_rew.plot(xs, ys, ".", alpha=0.35)
        sm = smoothed(r.reward_curve, reward["window"])
        if sm:
            ax_rew.plot(*zip(*sm, strict=True), color=line.get_color(),
                        label=f"{r.name} ({reward['window']}-step mean)")
        if r.time_to_reward_s is not None:
            ax_rew.plot([r.time_to_reward_s], [reward["threshold"]], "o", ms=9, mfc="none",
                        color=line.get_color())
    if reward is not None:
        ax_rew.axhline(reward["threshold"], ls="--", color="gray", lw=1,
                       label=f"level {reward['threshold']:.2f}")
    ax_rew.set_xlabel("seconds since first step")
    ax_rew.set_ylabel("reward mean")
    ax_rew.set_title("reward vs wall-clock")
    if ax_rew.get_legend_handles_labels()[0]:  # none before the first run's report
        ax_rew.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _device_name() -> str:
    """From NVML, not torch: a CUDA context here would hold GPU 0 memory during the runs."""
    pynvml, handles = _nvml_handles()
    if handles:
        name = pynvml.nvmlDeviceGetName(handles[0])
        return f"{len(handles)}x {name.decode() if isinstance(name, bytes) else name}"
    return f"CPU ({os.cpu_count()} cores)"


def prepare_model(spec: str, root: Path) -> str:
    """A size of bench.gpu_model ('0.5b', '1.5b', '3b', '7b') -> a random-init Qwen2 of that
    shape (written once); else a path/name."""
    from bench.gpu_model import SIZES

    if spec not in SIZES:
        return spec
    path = root / f"qwen2-{spec}"
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, "-m", "bench.gpu_model", str(path), "--size", spec],
                       check=True)
    return str(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_bench",
                                description=__doc__.split("\n")[0])
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="split")
    p.add_argument("--model", default="0.5b",
                   help="0.5b | 1.5b | 3b | 7b (random init, bench/gpu_model.py) | path | tiny")
    p.add_argument("--runs", default="sync,async1,async2",
                   help=f"comma list of {', '.join(RUNS)}, each also as ray-<name> (--launcher "
                        "ray)")
    p.add_argument("--gpus", default="",
                   help="the machine's GPU ids that the layout's GPUs 0, 1, ... are, e.g. 2,3 "
                        "(default: the same ids)")
    p.add_argument("--trl", default="",
                   help="comma list of colocate,server (TRL's GRPOTrainer), async (TRL's "
                        "AsyncGRPOTrainer; layout split) ('' = no TRL runs)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--batch-groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256,
                   help="completion length (throughput: exact, ignore_eos; reward: a cap)")
    p.add_argument("--task", choices=["throughput", "reward"], default="throughput",
                   help="throughput: fixed-length completions, samples/s; reward: completions "
                        "stop at EOS and the report adds the time to a common reward level")
    p.add_argument("--reward-window", type=int, default=5,
                   help="reward: steps in the trailing mean that levels are read from")
    p.add_argument("--reward-frac", type=float, default=0.8,
                   help="reward: the level is start + FRAC x (highest level all runs reach - "
                        "start)")
    p.add_argument("--reward-threshold", type=float, default=None,
                   help="reward: a fixed level instead (overrides --reward-frac)")
    p.add_argument("--lr", type=float, default=1e-6, help="learning rate of every run")
    p.add_argument("--gpu-mem", type=float, default=None,
                   help="engine.gpu_memory_utilization of each engine's GPU (default 0.15 on "
                        "colocated-2, 0.5 elsewhere)")
    p.add_argument("--config", type=Path, default=Path(__file__).with_name("bench.yaml"))
    p.add_argument("--set", action="append", default=[], help="extra KEY=VALUE for our runs")
    p.add_argument("--trl-arg", action="append", default=[],
                   help="extra argument of bench/trl_grpo.py (e.g. --trl-arg=--lora-rank=16)")
    p.add_argument("--run-timeout", type=float, default=600.0)
    p.add_argument("--models-dir", type=Path, default=Path("/tmp/bench-models"))
    p.add_argument("--out", type=Path, default=Path("runs/bench"))
    args = p.parse_args(argv)
    if args.gpu_mem is None:
        args.gpu_mem = GPU_MEM.get(args.layout, 0.5)
    bad = [r for r in args.runs.split(",") if r and r.removeprefix("ray-") not in RUNS]
    if bad:
        p.error(f"--runs: unknown {bad}; choose from {sorted(RUNS)}")
    bad = [r for r in args.trl.split(",") if r and r not in ("colocate", "server", "async")]
    if bad:
        p.error(f"--trl: unknown {bad}; choose from colocate, server, async")
    if "async" in args.trl.split(",") and args.layout != "split":
        p.error(f"--trl async runs TRL's server on GPU 0 and its trainer on GPU 1: layout split "
                f"only, not {args.layout}")
    if args.task == "reward" and args.trl:
        p.error("--task reward compares our modes only (bench/trl_grpo.py's prompts are fixed)")
    if args.reward_window < 1 or not 0.0 < args.reward_frac <= 1.0:
        p.error("--reward-window must be >= 1 and --reward-frac in (0, 1]")
    if args.warmup_steps + 2 > args.steps:
        p.error("--steps must exceed --warmup-steps by at least 2 (a steady window)")
    producers = max(len(LAYOUTS[args.layout][0]), 1)
    if args.batch_groups % producers:
        p.error(f"--batch-groups {args.batch_groups}: layout {args.layout} has {producers} "
                f"producers, and each step takes an equal share from each (e.g. "
                f"{args.batch_groups - args.batch_groups % producers or producers})")
    if args.layout in ("split-3x1", "split-tp2") and args.trl:
        p.error(f"--trl: TRL's runs here use 2 GPUs; layout {args.layout} has more (no "
                f"like-for-like)")
    need = 1 + max((int(g) for spec in [*LAYOUTS[args.layout][0], LAYOUTS[args.layout][1]]
                    for g in spec.split(",") if g), default=-1)
    ids = args.gpus.split(",") if args.gpus else []
    if args.gpus and (len(ids) < need or not all(i.isdigit() for i in ids) or
                      len(set(ids)) != len(ids)):
        p.error(f"--gpus {args.gpus}: layout {args.layout} needs {need} distinct GPU ids")
    return args


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Run each mode in turn and rewrite the report after every run. An outer ``timeout``
    SIGTERMs this process only: the handler turns that into SystemExit, so run_group stops the
    run's process group (else it keeps its GPU memory past the device call) and the report keeps
    the finished runs, with the cut one marked."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args.out.mkdir(parents=True, exist_ok=True)
    model = prepare_model(args.model, args.models_dir)
    device = _device_name()
    plan = ([(run_ours, r) for r in args.runs.split(",") if r]
            + [(run_trl, f"trl-{m}") for m in args.trl.split(",") if m])
    results: list[RunResult] = []

    def report() -> str:
        reward = (mark_time_to_reward(results, args.reward_window, args.reward_frac,
                                      args.reward_threshold) if args.task == "reward" else None)
        return write_report(args.out, results, args, device, reward)

    text = report()  # an empty table now: a broken report fails before any GPU time is spent
    for run, name in plan:
        t0 = time.time()
        try:
            results.append(run(args, name, model, args.out))
        except SystemExit as e:
            results.append(RunResult(name, False, round(time.time() - t0, 1),
                                     note=f"stopped by signal (exit {e.code}) during this run"))
            raise
        finally:
            text = report()
    print(text, flush=True)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
