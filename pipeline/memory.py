"""The memory plan of a run on its GPUs, checked before anything starts (``pipeline-train``).

Owns a lower bound of what each GPU must hold: the learner's share of the model state
(parameters x bytes per parameter / ranks, by DeepSpeed stage, precision and offload) plus the
engines' fixed share (``engine.gpu_memory_utilization`` of the GPU for each producer worker on
it). Activations, gathered layers, the CUDA context and fragmentation come on top: they get the
``FREE_AT_PEAK`` share of each learner GPU that the plan keeps out of its reach, so a plan
passes only if the model state and the engines fit in the rest (``bench.learner_bench
--processes`` measures the peaks that reserve has to hold). Pure functions, called by
``check_memory_plan`` with the model's config.json, the accelerate config and the GPUs' memory
(``nvidia-smi``; no GPU, no check).

The plan is a lower bound, not the peak. At 7B on 2 H200 the FSDP2 learner with packed,
checkpointed micro-batches (the 7B path: ``train.fsdp2``, ``train.packing``,
``train.gradient_checkpointing``) holds 61 GB of model state a rank and peaks at 89.6-91.3 GB
reserved (BENCHMARKS.md, "The learner alone, 7B"): 30 GB on top, more than the 10% kept free.
Beside the engines rank 0 holds about 19 GB more than rank 1 (the buffers it publishes versions
from): the whole run measured 90.3% of GPU 0 with engines at 0.15 and 8k-token micro-batches, 99.6%
with 0.25 and 16k, both of which this plan passes; so that layout's defaults come from the
measured runs, not from this plan.

Bytes per parameter of the learner (Adam, fp32 master weights and gradients):
  plain or DDP (fp32 weights, autocast)           4 + 4 + 8                = 16
  ZeRO-1/2, bf16 weights, state partitioned        2 + 16 / ranks
  ZeRO-3, everything partitioned                   (2 + 16) / ranks
  FSDP2 (train.fsdp2), fp32 shards, bf16 compute  16 / ranks
  optimizer offload (cpu/nvme): the 16 stay home   2 + 2 / ranks  (ZeRO-3: 4 / ranks)
  ZeRO-3 parameter offload too                     2 / ranks      (gradients only)
  LoRA: the frozen weights alone                   4 (plain), 2 (DeepSpeed bf16), / ranks at ZeRO-3
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.schedule import engine_count

GB = 1e9
FREE_AT_PEAK = 0.10  # of each GPU, kept for activations, gathered layers and the CUDA context


class MemoryPlanError(ValueError):
    """A plan that cannot fit (the message names the GPU, the figures and the options)."""


def model_parameters(hf: dict[str, Any]) -> int:
    """Parameters of a decoder-only transformer from its HF ``config.json`` (Llama, Qwen2,
    Mistral shapes: hidden, layers, intermediate, vocabulary, heads, KV heads, tied)."""
    text = hf.get("text_config") or {}
    get = lambda k, d=None: hf.get(k, text.get(k, d))  # noqa: E731 (multimodal configs nest)
    h, layers = int(get("hidden_size")), int(get("num_hidden_layers"))
    inter, vocab = int(get("intermediate_size")), int(get("vocab_size"))
    heads = int(get("num_attention_heads"))
    kv = int(get("num_key_value_heads") or heads)
    hd = int(get("head_dim") or h // heads)
    attn = h * heads * hd * 2 + h * kv * hd * 2  # q, o; k, v
    if get("attention_bias") or get("model_type") == "qwen2":
        attn += heads * hd + 2 * kv * hd
    per_layer = attn + 3 * h * inter + 2 * h  # gate, up, down; two norms
    tied = bool(get("tie_word_embeddings", False))
    return layers * per_layer + h + vocab * h * (1 if tied else 2)


@dataclass(frozen=True)
class LearnerSetup:
    """What decides the learner's bytes per parameter (read from the accelerate config)."""

    ranks: int = 1
    zero_stage: int = 0          # 0: no DeepSpeed (plain or DDP)
    bf16: bool = True            # DeepSpeed with bf16 weights (the shipped configs)
    offload_optimizer: bool = False
    offload_param: bool = False
    lora: bool = False
    fsdp2: bool = False          # train.fsdp2 (no DeepSpeed)


def bytes_per_param(s: LearnerSetup) -> float:
    """Per learner rank (see the module docstring's table)."""
    w = 2.0 if s.bf16 else 4.0
    if s.fsdp2:  # the sharded parameters are the fp32 master weights
        return 16.0 / s.ranks
    if s.zero_stage == 0:
        return 4.0 if s.lora else 16.0
    if s.lora:
        return w / s.ranks if s.zero_stage == 3 else w
    state = 0.0 if s.offload_optimizer else 16.0
    grads = 2.0 if s.offload_optimizer else 0.0  # bf16 gradients on the GPU before offload
    if s.zero_stage == 3:
        weights = 0.0 if s.offload_param else w
        return (weights + grads + state) / s.ranks
    return w + (grads + state) / s.ranks


@dataclass(frozen=True)
class GpuNeed:
    gpu: str
    total: float                  # bytes of GPU memory
    learner: float                # bytes of learner state on it
    engines: float                # bytes of engine share on it
    producers: int                # producer workers on it

    @property
    def need(self) -> float:
        return self.learner + self.engines

    @property
    def usable(self) -> float:
        """What the model state and the engines may take: all but ``FREE_AT_PEAK`` on a GPU
        with a learner rank (its activations peak there); an engine-only GPU is vLLM's to
        share out (``engine.gpu_memory_utilization``)."""
        return self.total * (1 - FREE_AT_PEAK) if self.learner else self.total


def plan(params: int, setup: LearnerSetup, learner_gpus: list[str],
         producer_gpus: list[list[str]], engine_util: float,
         gpu_total: dict[str, float]) -> list[GpuNeed]:
    """What each GPU holds: learner rank r on ``learner_gpus[r]``, one worker of producer k on
    each GPU of ``producer_gpus[k]``. GPUs not in ``gpu_total`` are not checked."""
    per_rank = params * bytes_per_param(setup)
    learner: dict[str, float] = {}
    for g in learner_gpus[:setup.ranks]:
        learner[g] = learner.get(g, 0.0) + per_rank
    workers: dict[str, int] = {}
    for gpus in producer_gpus:
        for g in gpus:
            workers[g] = workers.get(g, 0) + 1
    out = []
    for g in sorted(set(learner) | set(workers), key=lambda x: (len(x), x)):
        if g in gpu_total:
            total = gpu_total[g]
            out.append(GpuNeed(g, total, learner.get(g, 0.0),
                               workers.get(g, 0) * engine_util * total, workers.get(g, 0)))
    return out


def _label(s: LearnerSetup) -> str:
    if s.fsdp2:
        return "FSDP2"
    return {0: "plain", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}[s.zero_stage]


def _fits(needs: list[GpuNeed], setup: LearnerSetup, other: LearnerSetup) -> bool:
    """Whether every GPU's plan fits with the learner as ``other`` (same ranks, same GPUs)."""
    ratio = bytes_per_param(other) / bytes_per_param(setup)
    return all(n.learner * ratio + n.engines <= n.usable for n in needs)


def refusal(needs: list[GpuNeed], params: int, setup: LearnerSetup, engine_util: float
            ) -> str | None:
    """One line naming the first GPU whose plan does not fit (model state and engines beyond
    all but ``FREE_AT_PEAK`` of it) and the options that would make every GPU fit, or None."""
    over = [n for n in needs if n.need > n.usable]
    if not over:
        return None
    n = max(over, key=lambda x: x.need - x.usable)
    parts = [f"learner {n.learner / GB:.1f} GB ({params / 1e9:.2f}B parameters x "
             f"{bytes_per_param(setup):.1f} B each, {_label(setup)} over {setup.ranks} rank(s))"]
    if n.producers:
        parts.append(f"engines {n.engines / GB:.1f} GB ({n.producers} x "
                     f"engine.gpu_memory_utilization {engine_util:g})")
    options = []
    # The largest engine share that fits on every GPU that holds an engine.
    shares = [(m.usable - m.learner) / m.total / m.producers for m in needs if m.producers]
    fit = int(min(shares) * 100) / 100 if shares else 0.0
    if shares and fit >= 0.05:  # a smaller share still leaves the engine room for its KV cache
        options.append(f"--engine.gpu_memory_utilization {fit:g} or less")
    r = setup.ranks
    if r > 1 and not setup.lora and not setup.fsdp2 and _fits(
            needs, setup, LearnerSetup(ranks=r, fsdp2=True)):
        options.append("--train.fsdp2 true without --train.accelerate_config (FSDP2: "
                       f"{bytes_per_param(LearnerSetup(ranks=r, fsdp2=True)):g} B a parameter), "
                       "with --train.packing true --train.gradient_checkpointing true")
    zero3 = LearnerSetup(ranks=r, zero_stage=3, lora=setup.lora)
    if r > 1 and (setup.zero_stage != 3 or not setup.bf16) and _fits(needs, setup, zero3):
        options.append("--train.accelerate_config examples/accelerate/zero3.yaml (ZeRO-3, "
                       f"{bytes_per_param(zero3):g} B a parameter)")
    offload = LearnerSetup(ranks=r, zero_stage=3, offload_optimizer=True, offload_param=True,
                           lora=setup.lora)
    if not (setup.zero_stage == 3 and setup.offload_optimizer) and _fits(needs, setup, offload):
        options.append("--train.accelerate_config examples/accelerate/zero3_offload.yaml "
                       "(ZeRO-3, optimizer and parameters offloaded to the CPU)")
    if r > 1 and (setup.zero_stage == 3 or setup.fsdp2):
        options.append("more learner ranks on other GPUs (--train.learner_processes, "
                       "--learner_gpus)")
    elif r == 1:
        options.append("--train.accelerate_config examples/accelerate/zero3.yaml or "
                       "--train.fsdp2 true, with --train.learner_processes N over N GPUs")
    if not setup.lora and _fits(needs, setup, LearnerSetup(ranks=r, zero_stage=setup.zero_stage,
                                                          bf16=setup.bf16, lora=True)):
        options.append("--train.lora_rank 16")
    options.append("--launch.memory_check false to try anyway")
    room = (f"the {n.usable / GB:.1f} GB a plan may use ({1 - FREE_AT_PEAK:.0%} of "
            f"{n.total / GB:.1f} GB)" if n.learner else f"its {n.total / GB:.1f} GB")
    return (f"memory plan: GPU {n.gpu} needs at least {n.need / GB:.1f} GB of {room}: "
            f"{' + '.join(parts)}; to fit, use {'; or '.join(options)}")


# ------------------------------------------------------------------ inputs of the plan
def learner_setup(accelerate_config: str, ranks: int, lora: bool) -> LearnerSetup:
    """The DeepSpeed stage, precision and offload of an accelerate config file ('' = plain)."""
    if not accelerate_config:
        return LearnerSetup(ranks=ranks, lora=lora)
    import yaml

    conf = yaml.safe_load(Path(accelerate_config).read_text()) or {}
    if str(conf.get("distributed_type", "")).upper() != "DEEPSPEED":
        return LearnerSetup(ranks=ranks, lora=lora)
    ds = conf.get("deepspeed_config") or {}
    stage = int(ds.get("zero_stage", 0) or 0)
    opt_dev, par_dev = ds.get("offload_optimizer_device"), ds.get("offload_param_device")
    bf16 = str(conf.get("mixed_precision", "no")) in ("bf16", "fp16")
    if ds.get("deepspeed_config_file"):  # a DeepSpeed JSON of its own
        js = json.loads(Path(ds["deepspeed_config_file"]).read_text())
        zo = js.get("zero_optimization") or {}
        stage = int(zo.get("stage", stage))
        opt_dev = (zo.get("offload_optimizer") or {}).get("device", opt_dev)
        par_dev = (zo.get("offload_param") or {}).get("device", par_dev)
        bf16 = bool((js.get("bf16") or {}).get("enabled") or (js.get("fp16") or {})
                    .get("enabled") or bf16)
    off = lambda d: str(d or "none").lower() not in ("none", "")  # noqa: E731
    return LearnerSetup(ranks=ranks, zero_stage=stage, bf16=bf16,
                        offload_optimizer=off(opt_dev), offload_param=off(par_dev), lora=lora)


def gpu_memory() -> dict[str, float]:
    """Total memory of each GPU by index and UUID, from ``nvidia-smi`` ({} without one: the
    launcher never initialises CUDA itself, which would hold memory on GPU 0 for the run)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    try:
        out = subprocess.run([exe, "--query-gpu=index,uuid,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found: dict[str, float] = {}
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 3 and fields[2].isdigit():
            found[fields[0]] = found[fields[1]] = float(fields[2]) * 2 ** 20  # MiB
    return found


def visible(env: dict[str, str], gpus: dict[str, float]) -> list[str]:
    """The GPUs this launcher's children inherit: CUDA_VISIBLE_DEVICES, else every GPU."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return [g.strip() for g in cvd.split(",") if g.strip()]
    return sorted((g for g in gpus if g.isdigit()), key=int)


def check_memory_plan(cfg: Any, model_path: str, gpus: dict[str, float] | None = None,
                      env: dict[str, str] | None = None) -> None:
    """Raise MemoryPlanError (one line) when the run's plan cannot fit its GPUs. Skipped
    without GPUs (CPU machines), without a config.json, or with launch.memory_check false."""
    gpus = gpu_memory() if gpus is None else gpus
    conf = Path(model_path) / "config.json"
    if not gpus or not conf.is_file() or not cfg.launch.memory_check:
        return
    env = dict(os.environ) if env is None else env
    seen = visible(env, gpus)
    t = cfg.train
    ranks = max(1, t.learner_processes)
    learner = cfg.learner_gpus.split(",") if cfg.learner_gpus else seen[:ranks]
    tp = cfg.engine.tensor_parallel_size
    # Every engine: the producers' and a dedicated evaluator's (eval.producer), placed alike.
    engines = engine_count(cfg.producer_slots, cfg.eval.every, cfg.eval.producer)
    if cfg.producer_gpus:
        producers = [cfg.producer_gpus[k % len(cfg.producer_gpus)].split(",")
                     for k in range(engines)]
    else:
        producers = [seen[:tp] for _ in range(engines)]
    setup = LearnerSetup(ranks=ranks, fsdp2=True) if t.fsdp2 else \
        learner_setup(t.accelerate_config, ranks, t.lora_rank > 0)
    params = model_parameters(json.loads(conf.read_text()))
    needs = plan(params, setup, [g.strip() for g in learner],
                 [[g.strip() for g in p] for p in producers], cfg.engine.gpu_memory_utilization,
                 gpus)
    why = refusal(needs, params, setup, cfg.engine.gpu_memory_utilization)
    if why:
        raise MemoryPlanError(why)
