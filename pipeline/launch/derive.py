"""The values of a run that follow from other options, decided once, by the launcher, before any
process starts.

``resolve`` turns the config as written into the run's config: every derived value is stored
in its option, so ``run_dir/config.yaml`` carries the decisions to every role (the learner, its
accelerate ranks, each producer, the evaluator, Ray actors, ``pipeline-train eval`` of a
checkpoint) and no role makes them again, probes hardware for them, or recomputes the LoRA
adapter plan. What it decides:

- ``train.max_staleness``: 0 in sync mode (generate with v, train, publish v+1: on-policy);
- ``train.freeze_layers``: 0 with LoRA, which freezes the whole base already (so the demo's
  config still runs as documented with ``--train.lora_rank``);
- ``buffer_capacity``: when 0, 4 x the admission budget of the resolved staleness;
- ``sync.lora_adapters`` with LoRA: 'auto' becomes 'on' where the launcher sees a GPU and 'off'
  on CPU; 'on' becomes 'off' where vLLM cannot serve the adapter, 'merge' where an adapter file
  cannot carry it (``sync.lora.adapter_sync_plan``). Resolved, the option is the run's adapter
  plan (``RunConfig.adapter_plan``); adapter-only versions where weights are streamed are
  refused. A producer launched on its own (``--role producer``) does not decide 'auto': the
  learner's launcher did, from its own GPUs, and the producer must be told the same value;
- ``sync.route``: 'file' for adapter-only versions, which every producer loads from their files
  (a GPU copy offered on ipc or nccl would never be opened, and an IPC export is never freed).

Invariants: resolving a resolved config changes nothing and says nothing; the config passed in
is not modified; a value set to other than its default that a decision overrides is one
console line naming the option (``tell``). "Set" is "not the default": a default carries no
intent, and a config.yaml that lists every option still resolves silently.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from buffer.staleness import admission_budget
from pipeline.config import RunConfig, SyncConfig, TrainConfig
from pipeline.launch import placement
from pipeline.launch.console import tell
from pipeline.options import ConfigError

log = logging.getLogger(__name__)


def resolve(cfg: RunConfig, role: str = "all") -> RunConfig:
    """``cfg`` with every derived value decided (this module's docstring lists them) for a
    launch of ``role`` (all | learner | producer); a ConfigError when the decisions rule the
    config out."""
    train = _train(cfg.train)
    if role == "producer" and train.lora_rank and cfg.sync.lora_adapters == "auto":
        raise ConfigError(
            "sync.lora_adapters auto is decided by the learner's launcher (from its GPUs); a "
            "producer launched on its own (--role producer) must be given the same value: "
            "set sync.lora_adapters to the one in the learner's run_dir/config.yaml (on, merge "
            "or off)")
    sync = _sync(cfg.sync, train)
    capacity = cfg.buffer_capacity or 4 * admission_budget(train.batch_groups,
                                                           train.max_staleness)
    run = dataclasses.replace(cfg, train=train, sync=sync, buffer_capacity=capacity)
    _check_streamed_adapters(run)
    return run


def _train(t: TrainConfig) -> TrainConfig:
    changes: dict[str, Any] = {}
    if t.mode == "sync" and t.max_staleness:
        if t.max_staleness != _default(TrainConfig, "max_staleness"):
            tell(log, f"train.max_staleness {t.max_staleness} is ignored: train.mode sync "
                      "trains on-policy (max_staleness 0)")
        changes["max_staleness"] = 0
    if t.lora_rank and t.freeze_layers:
        tell(log, f"train.freeze_layers {t.freeze_layers} is ignored: train.lora_rank "
                  f"{t.lora_rank} trains LoRA adapters on a frozen base")
        changes["freeze_layers"] = 0
    return dataclasses.replace(t, **changes) if changes else t


def _sync(s: SyncConfig, t: TrainConfig) -> SyncConfig:
    """``sync.lora_adapters`` decided: with LoRA, 'on', 'merge' or 'off', what the run does."""
    mode = s.lora_adapters
    if not t.lora_rank or mode == "off":
        return s
    if mode == "auto":
        if placement.cuda_device_count() == 0:
            # vLLM's CPU build applies an adapter with torch ops that gather every token's A
            # and B (vllm.lora.ops.torch_ops): SmolLM2-135M generated at 0.12x of merged weights.
            log.info("sync.lora_adapters auto: merged weights on CPU (vLLM's CPU LoRA kernels "
                     "are slower than a merged-weight swap); 'on' serves adapters")
            return dataclasses.replace(s, lora_adapters="off")
        resolved = "on"
    else:
        resolved = mode
    from sync.lora import adapter_sync_plan

    served, why = adapter_sync_plan(resolved, t.lora_rank, list(t.lora_target_modules))
    if not served:
        ignored = "is ignored" if mode != "auto" else "(default)"
        tell(log, f"sync.lora_adapters {mode} {ignored}: LoRA versions ship as merged full "
                  f"weights: {why}")
        resolved = "off"
    changes: dict[str, Any] = {}
    if resolved != mode:
        changes["lora_adapters"] = resolved
    if resolved != "off" and s.route != "file":
        if s.route != _default(SyncConfig, "route"):
            tell(log, f"sync.route {s.route} is ignored: adapter-only versions (sync.lora_adapters "
                      f"{resolved}) are loaded from their snapshot files")
        changes["route"] = "file"
    return dataclasses.replace(s, **changes) if changes else s


def _check_streamed_adapters(cfg: RunConfig) -> None:
    """Adapters served as LoRA are read from the learner host's snapshot files; a producer that
    streams weights from another node (Ray, or sync.stream_from) has no such file. ('merge'
    versions load like full ones, streamed files included.)"""
    streams = bool(cfg.sync.stream_from) or (
        cfg.launch.backend == "ray" and cfg.launch.stream_weights != "never")
    if streams and cfg.adapter_plan.serving == "lora":
        raise ConfigError(
            "sync.lora_adapters: adapter-only versions need the learner host's snapshot files: "
            "set sync.lora_adapters=off (merged versions) when weights are streamed "
            "(sync.stream_from, or --launcher ray with launch.stream_weights other than never)")


def _default(cls: type, name: str) -> Any:
    """The declared default of option ``name`` of config section ``cls``."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()
