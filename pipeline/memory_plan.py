"""The learner's memory plan on its GPU, decided once by the launcher before anything starts.

Owns the choice of the memory options of a single-process learner on a GPU, from the model's
shape, LoRA or not, the optimiser state, the engines on the learner's GPU and the card's memory:
``train.gradient_checkpointing``, ``train.micro_batch_tokens``, ``train.logprob_chunk``,
``train.optimizer_state`` (AdamW moments in fp32 or bf16), ``train.expandable_segments`` (the
learner's CUDA allocator on segments that grow in place), ``sync.host_copies`` (the packed
versions the GPU routes serve from: on the learner's GPU or in pinned host memory) and, when the
learner cannot fit beside them, a smaller ``engine.gpu_memory_utilization`` sized to what the
engine needs (its bf16 weights and the KV cache of the sequences the run admits at once).
Why before the first step: an OOM in a backward costs the run; the same figures on paper cost
nothing, and one console line says what was chosen.

Invariants:
- A value the user set (not its default: ``pipeline.launch.derive``'s convention) is kept; one
  that the plan predicts will not fit gets one warning line with the plan's figure.
- Options are tried cheapest first: nothing that slows a step (bf16 moments) before what costs
  sync time (host copies) or compute (gradient checkpointing); large micro-batches first.
- The predicted learner peak is its allocator's reserved bytes during a backward (where it
  peaks): the model state (``state_bytes``), the packed versions (``version_bytes``), the
  activations of one micro-batch (``activation_bytes``) and what the caching allocator holds
  beyond them (``allocator_bytes``). The card's adds the engines' share, the CUDA contexts and
  the engines' copies of host-held versions. The per-token activation coefficients are
  measured on the CPU with
  ``python -m bench.memory_coefficients`` (saved tensors of Qwen2 layers under bf16 autocast);
  the head, allocator and context terms are fitted to the first H100 runs of ``bash
  bench/run_gpu.sh one-card`` (1.5B and 3B full, 7B LoRA; BENCHMARKS.md, "One 80 GB card"),
  whose table sets each prediction beside the measured peaks.

Pure functions, except ``apply_memory_plan`` (reads config.json and the GPUs' memory).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pipeline.memory import GB, model_parameters

TARGET = 0.85  # of the card: the plan's whole-card peak (engines + learner) stays below this
CEILING = 0.97  # when nothing fits TARGET: the cheapest plan below this, else the smallest
# On the card beyond the learner's reserved bytes and the engines' share: the CUDA contexts and
# cuBLAS workspaces (NVML peak - reserved peak - share: 2.15 GB at 1.5B, 2.25 GB at 7B, H100).
CONTEXT = 2.2e9
# A full fine-tune frees and re-allocates its fp32 gradients (zero_grad to None) and autocast's
# bf16 weight copies every step, between the activations' blocks: the allocator then reserves
# this fraction of those bytes on top of the allocated peak (reserved - allocated: 6.4 GB of
# 9.3 GB re-allocated at 1.5B, 11.3 GB of 18.5 GB at 3B; 1.1 GB at 7B LoRA, which re-allocates
# almost nothing).
FRAGMENTATION = 0.65
# The same with the learner's allocator on expandable segments (train.expandable_segments): a
# freed range is unmapped or reused in place rather than kept as a cached block of its size.
EXPANDABLE_FRAGMENTATION = 0.1
# Versions held in host memory: on the card beyond the learner's two bucket slots, as this many
# buckets (4.5 GB measured at 3B with 1 GiB buckets: the engine's copies of received buckets).
HOST_EXTRA_BUCKETS = 4
# Saved activations of a decoder layer per token under bf16 autocast (bench.memory_coefficients):
# bytes = H * hidden + I * intermediate + K * (kv heads x head dim). Full fine-tune (fp32 weights,
# fp32 residual stream) and LoRA on a bf16 base (bf16 residual stream).
LAYER_COEF = {False: (30.0, 8.0, 4.0), True: (24.0, 8.0, 6.0)}
# With gradient checkpointing only each layer's input is kept: the residual stream.
CHECKPOINT_COEF = {False: 4.0, True: 2.0}
# Bytes per (position x vocabulary entry) of one logprob chunk in the backward (its bf16 head
# output, fp32 copy, log-softmax and gradient, not all alive at once): fitted to the runs.
HEAD_COEF = 9.0
TOKENS = (16384, 8192, 4096, 2048, 1024, 512)  # micro-batch token budgets tried, largest first
NO_CHECKPOINT_MIN = 4096  # below this, checkpointed larger micro-batches are the better trade
CHUNKS = (4096, 2048, 1024, 512)
ENGINE_OVERHEAD = 2.5e9  # an engine's activations, CUDA graphs and context beside weights + KV
OptimizerState = Literal["fp32", "bf16"]


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a decoder-only model (HF ``config.json``)."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_dim: int  # KV heads x head dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Shape:
        text = hf.get("text_config") or {}
        get = lambda k, d=None: hf.get(k, text.get(k, d))  # noqa: E731 (nested configs)
        h, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        kv = int(get("num_key_value_heads") or heads)
        hd = int(get("head_dim") or h // heads)
        return cls(params=model_parameters(hf), layers=int(get("num_hidden_layers")), hidden=h,
                   intermediate=int(get("intermediate_size")), vocab=int(get("vocab_size")),
                   kv_dim=kv * hd)

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """Trainable parameters of rank-``rank`` LoRA on the named modules of every layer
        (A: rank x in, B: out x rank)."""
        h, i, kv = self.hidden, self.intermediate, self.kv_dim
        dims = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        return self.layers * sum(rank * (a + b) for m, (a, b) in dims.items() if m in targets)

    def kv_bytes_per_token(self) -> int:
        """An engine's bf16 KV cache per token (keys and values of every layer)."""
        return 2 * 2 * self.layers * self.kv_dim


@dataclass(frozen=True)
class Job:
    """What the run asks of the learner's GPU besides the memory options."""

    card: float                  # bytes of the learner's GPU
    engines: int                 # producer workers on the learner's GPU (colocated)
    engine_share: float          # engine.gpu_memory_utilization
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    adapter_only: bool = True    # LoRA versions carry the adapter alone
    bf16: bool = True            # model.dtype bfloat16: autocast keeps bf16 copies of weights
    gpu_routes: bool = True      # sync.route is not file: versions are served from packed copies
    bucket_bytes: float = 2**30  # sync.bucket_mb: a host-held version goes through 2 slots
    longest: int = 1024          # tokens of the longest sequence (engine.max_model_len)
    batch_tokens: int = 1 << 20  # tokens of one batch at most (rows x longest)
    admitted_tokens: int = 0     # tokens the engines may hold at once (their KV cache)


@dataclass(frozen=True)
class Options:
    """The memory options; None = the plan decides (the user left the default)."""

    gradient_checkpointing: bool | None = None
    micro_batch_tokens: int | None = None
    logprob_chunk: int | None = None
    optimizer_state: OptimizerState | None = None
    host_copies: bool | None = None
    engine_share: float | None = None
    expandable_segments: bool | None = None


@dataclass(frozen=True)
class Plan:
    gradient_checkpointing: bool
    micro_batch_tokens: int
    logprob_chunk: int
    optimizer_state: OptimizerState
    host_copies: bool
    engine_share: float
    learner: float        # predicted learner peak: its allocator's reserved bytes
    engines: float        # the engines' share of the card, bytes
    card: float
    parts: dict[str, float]  # the learner's parts, then "context" and "engine_copies"
    expandable_segments: bool = False

    @property
    def peak(self) -> float:
        """The whole card: the learner, the engines' share, the CUDA contexts and the engines'
        copies of received buckets."""
        return self.learner + self.engines + self.parts["context"] + self.parts["engine_copies"]

    @property
    def fits(self) -> bool:
        return self.peak <= TARGET * self.card

    def line(self) -> str:
        """The plan in one console line."""
        p = self.parts
        engine_copies = (f" + the engines' bucket copies {p['engine_copies'] / GB:.1f} GB"
                         if p["engine_copies"] else "")
        state = (f"model state {p['state'] / GB:.1f} GB (AdamW moments {self.optimizer_state})"
                 f", versions {p['versions'] / GB:.1f} GB "
                 f"({'host memory' if self.host_copies else 'on the GPU'})")
        return (f"memory plan: learner peak {self.learner / GB:.1f} GB [{state}, activations "
                f"{p['activations'] / GB:.1f} GB, allocator {p['allocator'] / GB:.1f} GB] + "
                f"engines {self.engines / GB:.1f} GB (gpu_memory_utilization "
                f"{self.engine_share:g}) + contexts {p['context'] / GB:.1f} GB"
                f"{engine_copies} = {self.peak / GB:.1f} of "
                f"{self.card / GB:.1f} GB ({self.peak / self.card:.0%}); gradient checkpointing "
                f"{'on' if self.gradient_checkpointing else 'off'}, {self._micro_batches()}, "
                f"logprob chunk {self.logprob_chunk}"
                f"{', expandable segments' if self.expandable_segments else ''}")

    def _micro_batches(self) -> str:
        if self.micro_batch_tokens:
            return f"micro-batches of {self.micro_batch_tokens} tokens"
        return "train.micro_batch rows a micro-batch"


def state_bytes(shape: Shape, job: Job, optimizer_state: OptimizerState) -> float:
    """The model state during a backward: full fine-tune = fp32 weights (4), fp32 gradients (4),
    AdamW moments (8, or 4 in bf16) and autocast's bf16 copies of the weights (2, cached for the
    step's autocast region); LoRA = the frozen bf16 base (2) and the adapter's 16."""
    moments = 8.0 if optimizer_state == "fp32" else 4.0
    if job.lora_rank:
        lora = shape.lora_params(job.lora_rank, list(job.lora_targets))
        return 2.0 * shape.params + (8.0 + moments) * lora
    return (8.0 + moments + (2.0 if job.bf16 else 0.0)) * shape.params


def _version_weights(shape: Shape, job: Job) -> float:
    """Bytes of one version: bf16 weights, or the adapter alone (LoRA adapter-only)."""
    return 2.0 * (shape.lora_params(job.lora_rank, list(job.lora_targets))
                  if job.lora_rank and job.adapter_only else shape.params)


def version_bytes(shape: Shape, job: Job, host_copies: bool) -> float:
    """The packed versions on the learner's side during a backward: the GPU routes keep the two
    newest (2 x bf16 weights; the next is packed after the step, when the activations are
    gone), or, held in host memory, two bucket slots per engine; the file route packs one copy
    for its writer. LoRA adapter-only versions are the adapter."""
    weights = _version_weights(shape, job)
    if not job.gpu_routes:
        return weights
    if host_copies:
        return 2.0 * min(job.bucket_bytes, weights) * max(job.engines, 1)
    return 2.0 * weights


def engine_copy_bytes(shape: Shape, job: Job, host_copies: bool) -> float:
    """Versions held in host memory: what the engines hold of received buckets beyond their
    share (``HOST_EXTRA_BUCKETS``)."""
    if not (host_copies and job.gpu_routes):
        return 0.0
    return HOST_EXTRA_BUCKETS * min(job.bucket_bytes, _version_weights(shape, job)) * job.engines


def allocator_bytes(shape: Shape, job: Job, expandable: bool = False) -> float:
    """What the caching allocator reserves beyond the allocated peak (``FRAGMENTATION``, or
    ``EXPANDABLE_FRAGMENTATION`` on expandable segments): a full fine-tune's gradients (4 bytes
    a parameter) and bf16 weight copies (2) come and go each step."""
    if job.lora_rank:
        return 0.0
    share = EXPANDABLE_FRAGMENTATION if expandable else FRAGMENTATION
    return share * (4.0 + (2.0 if job.bf16 else 0.0)) * shape.params


def activation_bytes(shape: Shape, tokens: int, checkpointing: bool, chunk: int,
                     lora: bool) -> float:
    """A micro-batch of ``tokens`` at the peak of its backward: the layers' saved activations
    (or only their inputs when checkpointed, plus the one layer recomputed), the output head's
    logprob chunk (all positions when ``chunk`` is 0) and the final hidden states."""
    a, b, c = LAYER_COEF[lora]
    layer = tokens * (a * shape.hidden + b * shape.intermediate + c * shape.kv_dim)
    if checkpointing:
        saved = shape.layers * tokens * CHECKPOINT_COEF[lora] * shape.hidden + layer
    else:
        saved = shape.layers * layer
    positions = min(chunk, tokens) if chunk > 0 else tokens
    return saved + HEAD_COEF * positions * shape.vocab + 8.0 * tokens * shape.hidden


def engine_need(shape: Shape, job: Job) -> float:
    """What one engine needs: bf16 weights, the KV cache of the tokens the run admits at once
    (x 1.5 for block rounding and prompts longer than planned), activations and CUDA graphs."""
    return (2.0 * shape.params + 1.5 * job.admitted_tokens * shape.kv_bytes_per_token()
            + ENGINE_OVERHEAD)


def _plan(shape: Shape, job: Job, share: float, ckpt: bool, tokens: int, chunk: int,
          state: OptimizerState, host: bool, expandable: bool = False) -> Plan:
    parts = {"state": state_bytes(shape, job, state), "versions": version_bytes(shape, job, host),
             "activations": activation_bytes(shape, tokens, ckpt, chunk, bool(job.lora_rank)),
             "allocator": allocator_bytes(shape, job, expandable)}
    learner = sum(parts.values())
    parts.update(context=CONTEXT, engine_copies=engine_copy_bytes(shape, job, host))
    return Plan(ckpt, tokens, chunk, state, host, share, learner,
                job.engines * share * job.card, job.card, parts, expandable)


def choose(shape: Shape, job: Job, fixed: Options) -> Plan:
    """The plan that fits (``Plan.fits``) at the least cost, the user's values kept; if none
    fits, the cheapest below ``CEILING`` of the card, else the one with the smallest peak (the
    caller warns with its figure either way)."""
    lora = bool(job.lora_rank)
    states: list[OptimizerState] = [fixed.optimizer_state] if fixed.optimizer_state else \
        (["fp32"] if lora else ["fp32", "bf16"])  # an adapter's moments are a few MB
    hosts = [fixed.host_copies] if fixed.host_copies is not None else \
        ([False] if lora or not job.gpu_routes else [False, True])
    shares = [job.engine_share]
    if fixed.engine_share is None and job.engines:
        need = round(engine_need(shape, job) / job.card + 0.005, 2)
        if need < job.engine_share:
            shares.append(need)
    longest = min(job.longest, job.batch_tokens)
    tokens = [fixed.micro_batch_tokens] if fixed.micro_batch_tokens is not None else \
        [t for t in TOKENS if longest <= t < 2 * job.batch_tokens] or [longest]
    chunks = [fixed.logprob_chunk] if fixed.logprob_chunk is not None else list(CHUNKS)
    ckpts = [fixed.gradient_checkpointing] if fixed.gradient_checkpointing is not None else \
        [False, True]
    # Expandable segments cost nothing a step: on for a full fine-tune unless the user said.
    expandable = fixed.expandable_segments if fixed.expandable_segments is not None else \
        not lora
    candidates = []
    # Cheapest first: the optimiser state (no cost), then the engine share, then host copies
    # (sync time); within those, no checkpointing with micro-batches of NO_CHECKPOINT_MIN tokens
    # or more, else checkpointing; the largest micro-batch, then the largest chunk.
    for host in hosts:
        for share in shares:
            for state in states:
                for ckpt in ckpts:
                    for t in tokens:
                        if not ckpt and len(ckpts) > 1 and t < NO_CHECKPOINT_MIN:
                            continue
                        for c in chunks:
                            p = _plan(shape, job, share, ckpt, t, c, state, host,
                                      expandable)
                            if p.fits:
                                return p
                            candidates.append(p)
    below = [p for p in candidates if p.peak <= CEILING * p.card]
    return below[0] if below else min(candidates, key=lambda p: p.peak)


def options_from_config(cfg: Any) -> Options:
    """The memory options the user set (not their defaults) in a RunConfig."""
    from pipeline.config import EngineConfig, TrainConfig

    t, defaults = cfg.train, TrainConfig()
    mine = lambda obj, default, name: (  # noqa: E731
        getattr(obj, name) if getattr(obj, name) != getattr(default, name) else None)
    tokens = mine(t, defaults, "micro_batch_tokens")
    if tokens is None and t.micro_batch != defaults.micro_batch:
        tokens = 0  # the user's row count: no token budget of the plan's
    state = t.optimizer_state if t.optimizer_state != "auto" else None
    return Options(gradient_checkpointing=mine(t, defaults, "gradient_checkpointing"),
                   micro_batch_tokens=tokens, logprob_chunk=mine(t, defaults, "logprob_chunk"),
                   optimizer_state=state, host_copies=cfg.sync.host_copies,
                   engine_share=mine(cfg.engine, EngineConfig(), "gpu_memory_utilization"),
                   expandable_segments=t.expandable_segments)


def job_from_config(cfg: Any, card: float, engines: int) -> Job:
    """The Job of a RunConfig whose learner's GPU has ``card`` bytes and ``engines`` workers."""
    from pipeline.config import completion_max_tokens

    t, g = cfg.train, cfg.generation
    longest = cfg.engine.max_model_len
    per_seq = min(longest, completion_max_tokens(cfg) + 256)  # a prompt allowance
    admitted = t.batch_groups * g.group_size * (t.max_staleness + 1) * per_seq
    return Job(card=card, engines=engines, engine_share=cfg.engine.gpu_memory_utilization,
               lora_rank=t.lora_rank, lora_targets=tuple(t.lora_target_modules),
               adapter_only=cfg.sync.lora_adapters in ("on", "merge"),
               bf16=cfg.model.dtype == "bfloat16", gpu_routes=cfg.sync.route != "file",
               bucket_bytes=cfg.sync.bucket_mb * 2**20, longest=longest,
               batch_tokens=t.batch_groups * g.group_size * longest,
               admitted_tokens=admitted)


def warnings(plan: Plan, fixed: Options) -> list[str]:
    """One line naming the values the user set when the plan with them does not fit."""
    if plan.fits:
        return []
    figure = (f"the plan predicts {plan.peak / GB:.1f} GB of {plan.card / GB:.1f} GB "
              f"({plan.peak / plan.card:.0%}, more than {TARGET:.0%})")
    set_by_user = {k: v for k, v in dataclasses.asdict(fixed).items() if v is not None}
    if not set_by_user:
        return [f"memory plan: no plan fits {TARGET:.0%} of the card: {figure}; to fit, use "
                f"LoRA (--train.lora_rank 16), a sharded learner (--train.fsdp2 over several "
                f"GPUs) or a larger GPU"]
    names = {"engine_share": "engine.gpu_memory_utilization", "host_copies": "sync.host_copies"}
    given = ", ".join(f"{names.get(k, 'train.' + k)} {v}" for k, v in set_by_user.items())
    return [f"memory plan: {given} will not fit: {figure}"]


def apply(cfg: Any, plan: Plan) -> Any:
    """``cfg`` with the plan's choices in its options (a new RunConfig)."""
    train = dataclasses.replace(cfg.train, gradient_checkpointing=plan.gradient_checkpointing,
                                micro_batch_tokens=plan.micro_batch_tokens,
                                logprob_chunk=plan.logprob_chunk,
                                optimizer_state=plan.optimizer_state,
                                expandable_segments=plan.expandable_segments)
    sync = dataclasses.replace(cfg.sync, host_copies=plan.host_copies)
    engine = dataclasses.replace(cfg.engine, gpu_memory_utilization=plan.engine_share)
    return dataclasses.replace(cfg, train=train, sync=sync, engine=engine)


def learner_gpu(cfg: Any, env: dict[str, str], gpus: dict[str, float]) -> tuple[str, int] | None:
    """The single-process learner's GPU and the engine workers on it; None where the plan does
    not apply (no GPU, several learner ranks, DeepSpeed)."""
    from pipeline.memory import visible

    t = cfg.train
    if not gpus or t.learner_processes > 1 or t.accelerate_config or t.fsdp2:
        return None
    seen = visible(env, gpus)
    gpu = (cfg.learner_gpus.split(",") if cfg.learner_gpus else seen[:1] or ["0"])[0].strip()
    tp = cfg.engine.tensor_parallel_size
    specs = [cfg.producer_gpus[k % len(cfg.producer_gpus)].split(",")
             for k in range(cfg.num_producers)] if cfg.producer_gpus else \
        [seen[:tp]] * cfg.num_producers
    engines = sum(gpu in [g.strip() for g in spec] for spec in specs)
    return (gpu, engines) if gpu in gpus else None


def apply_memory_plan(cfg: Any, model_path: str, gpus: dict[str, float] | None = None,
                      env: dict[str, str] | None = None) -> tuple[Any, Plan | None, list[str]]:
    """The run's config with the plan applied, the plan, and its console lines (the plan, then
    any warnings); ``cfg`` unchanged, no plan and no lines without a GPU, a config.json, or with
    launch.memory_check false. Writes nothing."""
    import os

    from pipeline.memory import gpu_memory

    conf = Path(model_path) / "config.json"
    if not cfg.launch.memory_check or not conf.is_file():
        return cfg, None, []
    gpus = gpu_memory() if gpus is None else gpus
    where = learner_gpu(cfg, dict(os.environ) if env is None else env, gpus)
    if where is None:
        return cfg, None, []
    gpu, engines = where
    shape = Shape.from_hf(json.loads(conf.read_text()))
    job = job_from_config(cfg, gpus[gpu], engines)
    fixed = options_from_config(cfg)
    rows = fixed.micro_batch_tokens == 0  # the user's row count, sized as rows x longest
    if rows:
        fixed = dataclasses.replace(fixed, micro_batch_tokens=min(
            cfg.train.micro_batch * job.longest, job.batch_tokens))
    plan = choose(shape, job, fixed)
    if rows:
        plan = dataclasses.replace(plan, micro_batch_tokens=0)
        fixed = dataclasses.replace(fixed, micro_batch_tokens=None)
    return apply(cfg, plan), plan, [f"{plan.line()} (GPU {gpu})", *warnings(plan, fixed)]


def record(plan: Plan) -> dict[str, Any]:
    """The plan as run_dir/memory_plan.json keeps it (the bench sets it beside the measured
    peaks): its choices and predicted bytes."""
    return {**{k: v for k, v in dataclasses.asdict(plan).items() if k != "parts"},
            "parts": plan.parts, "peak": plan.peak, "fits": plan.fits, "line": plan.line()}
