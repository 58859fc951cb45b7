"""The policy and its optimiser: turns a batch of rollout groups into one GRPO optimiser step.

Synchronous torch code only (the learner runs it in a worker thread so that its event loop keeps
receiving groups). Owns: model loading (optionally LoRA through peft), micro-batched
forward/backward (batch layouts and micro-batch plans: ``pipeline.learner.batching``) with the loss
from ``pipeline.learner.loss``, log-probabilities computed in vocabulary chunks, the per-step
throughput and MFU (``pipeline.learner.flops``), the non-finite-step guard, and the
weights that go into snapshots (LoRA merged into plain HF names by ``pipeline.learner.lora``, so
vLLM loads them as full weights).

Model and optimiser go through an ``accelerate.Accelerator``: one process by default; under
``accelerate launch`` (DDP, DeepSpeed ZeRO) rank 0 drives and the other ranks ``follow()``: every
public method that runs a collective first broadcasts its command
(``pipeline.learner.distributed``), and each rank trains on its slice of the batch's completions
with a batch-global token normaliser.

Under DeepSpeed the engine owns the update: micro-batches mark the accumulation boundary
themselves (the config's gradient_accumulation_steps is forced to 1), every rank runs the same
number of micro-batches (ZeRO-2/3 communicate in each backward, ZeRO-3 in each forward), the
engine's ``step()`` clips with ``train.grad_clip`` and skips a step whose gradient norm is not
finite. Snapshots gather ZeRO-3 partitions onto rank 0; checkpoints hold every rank's optimiser
(and ZeRO-3 parameter) partition through DeepSpeed's checkpoint API (``save_shards``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from buffer.schema import RolloutGroup
from pipeline.config import RunConfig
from pipeline.learner import distributed as D
from pipeline.learner.attention import register as register_varlen
from pipeline.learner.attention import varlen_kwargs
from pipeline.learner.batching import (
    PackedBatch,
    collate,
    collate_packed,
    pack_groups,
    plan_micro_batches,
)
from pipeline.learner.checkpoint import CheckpointError
from pipeline.learner.flops import ModelShape, peak_flops, train_flops
from pipeline.learner.lora import lora_modules, merge_lora
from pipeline.learner.loss import grpo_loss
from sync.lora import adapter_sync_plan, adapter_tensors
from sync.packing import plan_buckets, plan_layout_of

log = logging.getLogger(__name__)
DEEPSPEED_DIR = "deepspeed"  # inside a checkpoint dir: DeepSpeed's files, every rank's partitions
DEEPSPEED_TAG = "zero"


def reward_means(groups: list[RolloutGroup]) -> dict[str, float]:
    """``reward/<name>``: each reward's mean over the completions it scored (a reward that
    returned None for a completion, TRL's "not scored", leaves it out of its breakdown)."""
    sums: dict[str, list[float]] = {}
    for g in groups:
        for c in g.completions:
            for k, v in c.reward_breakdown.items():
                sums.setdefault(k, []).append(v)
    return {f"reward/{k}": float(np.mean(sums[k])) for k in sorted(sums)}


def _head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor
                   ) -> torch.Tensor:
    """log pi(target) from hidden states: the output projection and a fused log-softmax +
    gather (cross-entropy), in fp32 over the vocabulary."""
    return -torch.nn.functional.cross_entropy(head(hidden).float(), targets, reduction="none")


def selected_logprobs(model: Any, input_ids: torch.Tensor, select: torch.Tensor,
                      attention_mask: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None, chunk: int = 0,
                      **attention: Any) -> torch.Tensor:
    """log pi(x_t | x_<t) of the tokens whose predicting position ``select`` marks (``select`` is
    aligned with positions [:, :-1]); a flat (K,) tensor, row by row.

    The output projection and softmax run only on the selected positions: with a large
    vocabulary they dominate the cost, and prompt positions carry no loss. With ``chunk`` > 0 they
    run ``chunk`` positions at a time, each chunk recomputed in the backward pass
    (``torch.utils.checkpoint``), so the fp32 logits of at most one chunk exist at once instead
    of K x vocabulary of them. ``attention``: keyword arguments for the attention layers (a
    packed row's sequence boundaries, ``pipeline.learner.attention.varlen_kwargs``).
    """
    if hasattr(model, "get_base_model"):  # peft: the HF model with LoRA layers injected
        model = model.get_base_model()
    # No KV cache: it is never read in training, and with one transformers only reads packed
    # sequences' boundaries from the position ids when there is none.
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids, use_cache=False, **attention
                              ).last_hidden_state[:, :-1]
    h = hidden[select]
    targets = input_ids[:, 1:][select]
    head = model.get_output_embeddings()
    if chunk <= 0 or len(h) <= chunk:
        return _head_logprobs(head, h, targets)
    from torch.utils.checkpoint import checkpoint

    return torch.cat([checkpoint(_head_logprobs, head, h[i: i + chunk], targets[i: i + chunk],
                                 use_reentrant=False) for i in range(0, len(h), chunk)])


def token_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   mask: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """log pi(x_t | x_<t) for t >= 1, shape (B, L-1); 0 where ``mask`` is False."""
    return _on_grid(selected_logprobs(model, input_ids, mask, attention_mask=attention_mask,
                                      chunk=chunk), mask)


def _on_grid(flat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Flat logprobs of the selected positions onto the loss-side grid (``batching``)."""
    out = torch.zeros(mask.shape, dtype=flat.dtype, device=flat.device)
    return out.masked_scatter(mask, flat)


class _Policy(torch.nn.Module):
    """The model behind one ``forward`` that returns token logprobs: DDP and DeepSpeed hook
    their gradient reduction into the wrapped module's forward, so it must be called, not
    ``model.base_model`` directly."""

    def __init__(self, model: torch.nn.Module, chunk: int = 0):
        super().__init__()
        self.model = model
        self.chunk = chunk

    def forward(self, input_ids, select, attention_mask=None, position_ids=None, **attention):
        return selected_logprobs(self.model, input_ids, select, attention_mask, position_ids,
                                 self.chunk, **attention)


def make_accelerator(cuda: bool) -> Any:
    """One process on CPU/GPU by default; under `accelerate launch` the launcher's env (and its
    --config_file: DDP, DeepSpeed ZeRO-2/3, offload) decides."""
    from accelerate import Accelerator

    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true" and not cuda:
        # DeepSpeed on CPU (DS_ACCELERATOR=cpu; tests): accelerate ignores DeepSpeed with
        # cpu=True and names a backend only for accelerators, so name gloo.
        from accelerate.utils import InitProcessGroupKwargs

        return Accelerator(cpu=False, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    return Accelerator(cpu=not cuda)


class PolicyTrainer:
    def __init__(self, cfg: RunConfig, model_path: str, device: str | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        t = cfg.train
        torch.manual_seed(t.seed)
        cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
        self.accelerator = make_accelerator(cuda)
        self.device = self.accelerator.device
        self.world = D.world_size() if D.is_distributed() else 1
        self.rank = D.rank() if self.world > 1 else 0
        # DeepSpeed's plugin (None without DeepSpeed); its config is adjusted before any model
        # is built: ZeRO-3's zero3_init_flag makes from_pretrained load partitions only.
        self.deepspeed = self.accelerator.state.deepspeed_plugin
        self.zero_stage = 0
        if self.deepspeed is not None:
            self.zero_stage = self._configure_deepspeed(self.deepspeed.deepspeed_config)
        self._lock = threading.Lock()  # a command and its collectives are never interleaved
        self._released = False
        # fp32 master weights; bf16 autocast on GPUs (CPU autocast is slower than fp32 here);
        # DeepSpeed with bf16 keeps bf16 weights and fp32 masters in the optimiser partitions.
        # Packed rows need attention that stays inside each sequence (pipeline.learner.attention).
        self.attn = {"attn_implementation": register_varlen()} if t.packing else {}
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, **self.attn)
        if t.gradient_checkpointing:
            model.config.use_cache = False
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        if t.freeze_layers:
            self._freeze(model, t.freeze_layers)
        self._lora: dict[str, float] = {}
        if t.lora_rank > 0:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(
                r=t.lora_rank, lora_alpha=t.lora_alpha, lora_dropout=t.lora_dropout,
                target_modules=list(t.lora_target_modules), bias="none"))
            self._lora = lora_modules(model)
        # Adapter sync: each version ships the LoRA tensors alone (sync.lora); producers decide
        # with the same function, so both sides agree on what a snapshot holds.
        self.adapter_sync, why = adapter_sync_plan(
            cfg.sync.lora_adapters, t.lora_rank, list(t.lora_target_modules))
        if why and self.rank == 0:
            log.warning("LoRA versions ship as merged full weights: %s", why)
        model.train()
        self.model = model
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        params = [p for p in self.model.parameters() if p.requires_grad]
        # One fused kernel for the whole update on a GPU (DeepSpeed keeps its own partitions).
        fused = cuda and self.deepspeed is None
        optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay,
                                      fused=fused or None)
        warm = max(t.warmup_steps, 0)
        # The scheduler stays outside accelerate: it steps once per optimiser step, not per rank.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        self.policy, self.optimizer = self.accelerator.prepare(
            _Policy(self.model, t.logprob_chunk), optimizer)
        self.ref_model = self._reference(model_path) if t.loss.kl_coef > 0 else None
        self.snapshot_dtype = getattr(torch, cfg.model.dtype)
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        self._skip = {"lm_head.weight"} if tied else set()
        self._shape, self._peak = None, None  # for the mfu metric (pipeline.learner.flops)
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            self._shape = ModelShape.from_config(self.model.config)
        if self.device.type == "cuda":
            self._peak = peak_flops(torch.cuda.get_device_name(self.device))

    @property
    def vocab_size(self) -> int:
        """Token ids the model can embed and score: [0, vocab_size)."""
        rows = self.model.get_input_embeddings().num_embeddings
        return min(int(getattr(self.model.config, "vocab_size", rows) or rows), int(rows))

    def _configure_deepspeed(self, c: dict[str, Any]) -> int:
        """Our micro-batching, clipping and gathering in the DeepSpeed config; returns the stage.

        The batch's micro-batches are ours (one accumulation boundary per batch), so DeepSpeed
        accumulates over exactly one "step"; ``train.grad_clip`` is the one clipping knob;
        ZeRO-3 must gather full weights for snapshots; CPU offload runs the client AdamW on the
        CPU partitions (DeepSpeedCPUAdam would need a compiled op).
        """
        t = self.cfg.train
        for key, ours in (("gradient_accumulation_steps", 1), ("gradient_clipping", t.grad_clip)):
            theirs = c.get(key, "auto")
            if theirs not in ("auto", ours):
                log.warning("DeepSpeed config %s=%s replaced by %s (set by train.micro_batch / "
                            "train.grad_clip)", key, theirs, ours)
        c.update({"train_micro_batch_size_per_gpu": t.micro_batch,
                  "gradient_accumulation_steps": 1,
                  "train_batch_size": t.micro_batch * self.world,
                  "gradient_clipping": t.grad_clip})
        zo = c.setdefault("zero_optimization", {})
        stage = int(zo.get("stage", 0))
        if stage == 3:
            zo["stage3_gather_16bit_weights_on_model_save"] = True
        if (zo.get("offload_optimizer") or {}).get("device", "none") not in ("none", None):
            c.setdefault("zero_force_ds_cpu_optimizer", False)
        return stage

    def _reference(self, model_path: str) -> Any:
        """The frozen reference for the KL term, behind the same token-logprob forward."""
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, **self.attn)
        ref = _Policy(ref, self.cfg.train.logprob_chunk).eval().requires_grad_(False)
        if self.zero_stage != 3:
            return ref.to(self.device)
        # ZeRO-3: the reference is as large as the policy, so it is partitioned like it (loaded
        # partitioned under zero3_init_flag): an inference engine, no optimiser. Its forward
        # gathers layer by layer, a collective that every rank runs (same micro-batch count).
        import deepspeed

        conf = copy.deepcopy(self.deepspeed.deepspeed_config)
        for key in ("optimizer", "scheduler"):
            conf.pop(key, None)
        engine, *_ = deepspeed.initialize(model=ref, config=conf)
        engine.eval()
        return engine

    @staticmethod
    def _freeze(model: Any, k: int) -> None:
        layers = model.base_model.layers
        if k > len(layers):
            raise ValueError(f"train.freeze_layers={k} but the model has {len(layers)} layers")
        model.get_input_embeddings().requires_grad_(False)
        for layer in layers[:k]:
            layer.requires_grad_(False)

    def _autocast(self):
        """bf16 autocast where the hardware has bf16 math (GPUs, AVX512-BF16/AMX CPUs: ~5x
        faster matmuls than fp32 on the 2-core dev machines); fp32 master weights either way."""
        if self.cfg.model.dtype != "bfloat16":
            return torch.autocast(self.device.type, enabled=False)
        if self.device.type == "cpu" and not torch.cpu._is_avx512_bf16_supported():
            return torch.autocast("cpu", enabled=False)
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    # -------------------------------------------------------------- rank 0 leads, others follow
    def _lead(self, *cmd: Any) -> None:
        if self.world > 1 and self.rank == 0:
            D.broadcast_object(cmd)

    def follow(self) -> None:
        """Non-zero ranks: run rank 0's commands until it says stop (or the job dies)."""
        while True:
            cmd = D.broadcast_object(None)
            op, args = cmd[0], cmd[1:]
            if op == "stop":
                return
            if op == "step":
                try:
                    self._step(*args)
                except Exception as e:  # rank 0 drops this batch too (Learner._train_batch)
                    log.error("rank %d: training step raised %s: %s; batch dropped", self.rank,
                              type(e).__name__, e)
                continue
            if op == "buckets":  # run the gathers in step with rank 0; rank 0 keeps the data
                for _ in self._snapshot_buckets(*args):
                    pass
                continue
            {"grads": self._accumulate, "snapshot": self._snapshot, "state": self._state,
             "load": self._load_state, "save": self._save_shards}[op](*args)

    def release_followers(self) -> None:
        """Rank 0, at the end: let the other ranks return from ``follow()``."""
        with self._lock:
            if not self._released:
                self._released = True
                self._lead("stop")

    # -------------------------------------------------------------- training
    def step(self, groups: list[RolloutGroup], learner_version: int) -> dict[str, float]:
        """One optimiser step on ``groups``; returns metrics. A non-finite loss or gradient
        skips the update (``skipped_nonfinite`` = 1) so bad weights never reach producers."""
        with self._lock:
            self._lead("step", groups, learner_version)
            return self._step(groups, learner_version)

    def accumulate_gradients(self, groups: list[RolloutGroup]) -> dict[str, float]:
        """Forward/backward only: leaves the (rank-averaged) gradients of the batch loss in
        ``.grad`` (for tests and debugging); returns the loss metrics. Not under DeepSpeed,
        whose gradients live in ZeRO partitions until its ``step()``."""
        if self.deepspeed is not None:
            raise NotImplementedError("accumulate_gradients under DeepSpeed")
        with self._lock:
            self._lead("grads", groups)
            return self._accumulate(groups)[1]

    def _plan(self, pb: PackedBatch, rank: int) -> list[list[int]]:
        """Rank ``rank``'s micro-batches: its slice of the completions, by rows or tokens."""
        t = self.cfg.train
        mine = D.shard_rows(len(pb.sequences), rank, self.world)
        return plan_micro_batches(pb.lengths(), mine, t.micro_batch, t.micro_batch_tokens,
                                  t.packing)

    def _collate(self, pb: PackedBatch, rows: list[int]) -> tuple[dict[str, torch.Tensor],
                                                                  dict[str, Any]]:
        """The micro-batch on the device, and the model's keyword arguments (a packed row's
        sequence boundaries, computed here on the host so the forward never waits for them)."""
        if not self.cfg.train.packing:
            b = collate(pb, rows, self.pad_id)
            return {k: v.to(self.device, non_blocking=True) for k, v in b.items()}, {}
        b = collate_packed(pb, rows)
        bounds = varlen_kwargs(b["position_ids"])
        bounds = {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v
                  for k, v in bounds.items()}
        return {k: v.to(self.device, non_blocking=True) for k, v in b.items()}, bounds

    def _accumulate(self, groups: list[RolloutGroup]) -> tuple[PackedBatch, dict[str, float],
                                                              bool, int]:
        """Forward/backward over this rank's micro-batches; the gradient of the batch loss is
        left in ``.grad`` (or DeepSpeed's partitions). No host synchronisation until every
        micro-batch is queued: metrics and the finite flag stay on the device until the end."""
        lc = self.cfg.train.loss
        pb = pack_groups(groups, lc.scale_rewards, lc.std_eps)
        # Global normaliser: the loss tokens of the whole batch, on every rank. They are the
        # sampled completion tokens; an episode's tool tokens are context, never counted.
        loss_tokens = sum(pb.loss_tokens(i) for i in range(len(pb.sequences)))
        normalizer = float(max(loss_tokens, 1))
        # A rank without rows still runs one zero-weighted backward: DDP/ZeRO reductions are
        # collectives that every rank must enter.
        chunks = [(rows, 1.0) for rows in self._plan(pb, self.rank)] or [([0], 0.0)]
        ds = self.deepspeed is not None
        if ds:  # ZeRO-2/3 communicate in every backward (ZeRO-3 also in every forward)
            most = max(len(self._plan(pb, r)) for r in range(self.world))
            chunks += [([0], 0.0)] * (most - len(chunks))
        self.optimizer.zero_grad(set_to_none=True)
        acc: dict[str, torch.Tensor] = {}
        bad = torch.zeros((), dtype=torch.bool, device=self.device)
        # One autocast region for the whole step: autocast casts each fp32 weight to bf16 once
        # and caches it while the region lasts, instead of once per micro-batch.
        with self._autocast():
            for ci, (rows, keep) in enumerate(chunks):
                b, attention = self._collate(pb, rows)
                model_in = {k: b[k] for k in ("input_ids", "select", "attention_mask",
                                              "position_ids") if k in b} | attention
                last = ci == len(chunks) - 1
                if ds:
                    self.policy.set_gradient_accumulation_boundary(last)
                sync = contextlib.nullcontext() if last or ds else \
                    self.accelerator.no_sync(self.policy)
                with sync:
                    lp = _on_grid(self.policy(**model_in), b["mask"])
                    ref = None
                    if self.ref_model is not None:
                        with torch.no_grad():
                            ref = _on_grid(self.ref_model(**model_in), b["mask"])
                    out = grpo_loss(lp, b["behaviour"], b["advantages"], b["mask"].float(), lc,
                                    ref_logprobs=ref,
                                    normalizer=normalizer if lc.agg == "token_mean" else
                                    float(len(pb.sequences)), tensor_metrics=True)
                    loss = out.loss
                    # A non-finite loss is back-propagated anyway (the update is skipped after all
                    # micro-batches): ranks stay in step and DeepSpeed reaches its boundary.
                    bad = bad | ~torch.isfinite(loss.detach())
                    # Gradient reduction averages over ranks; the loss is a sum over the global
                    # batch, so undo the 1/world.
                    if ds:  # not accelerator.backward: under DeepSpeed it steps at each call
                        self.policy.backward(loss * (keep * self.world))
                    else:
                        self.accelerator.backward(loss * (keep * self.world))
                if keep:
                    weight = b["mask"].sum() / normalizer
                    for k, v in out.metrics.items():
                        if k.endswith("_max"):  # the largest over the batch, not a mean
                            acc[k] = torch.maximum(acc[k], v) if k in acc else v
                        else:
                            acc[k] = acc.get(k, 0.0) + v * (1.0 if k == "loss" else weight)
        keys = sorted(acc)
        values = torch.stack([acc[k].float() for k in keys] + [bad.float()]).tolist()
        finite = values.pop() == 0.0
        return pb, D.sum_dicts(dict(zip(keys, values, strict=True))), finite, loss_tokens

    def _step(self, groups: list[RolloutGroup], learner_version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        pb, acc, finite, loss_tokens = self._accumulate(groups)
        n = len(pb.sequences)
        grad_norm = math.nan
        if self.deepspeed is not None:
            finite = D.all_true(finite, self.device)
            # Clips (train.grad_clip) and skips an update whose gradient norm is not finite.
            self.policy.step()
            norm = self.policy.get_global_grad_norm()
            grad_norm = float(norm) if norm is not None else math.nan
            finite = finite and self.policy.was_step_applied()
            if finite:
                self.scheduler.step()
        else:
            if finite or self.world > 1:
                clip = self.cfg.train.grad_clip
                params = [p for p in self.policy.parameters() if p.requires_grad]
                grad_norm = float(self.accelerator.clip_grad_norm_(
                    params, clip if clip > 0 else float("inf")))
                finite = finite and math.isfinite(grad_norm)
            finite = D.all_true(finite, self.device)
            if finite:
                self.optimizer.step()
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # train_s covers the queued optimiser kernels
        train_s = time.perf_counter() - t0
        completion = [len(s) - p for s, p in zip(pb.sequences, pb.prompt_lens, strict=True)]
        vers = np.concatenate([v for v in pb.versions if len(v)]) if sum(completion) else \
            np.zeros(0)
        stale = [learner_version - g.policy_version for g in groups]
        metrics = {f"loss/{k}": v for k, v in acc.items()}
        metrics.update({
            "reward_mean": float(pb.rewards.mean()),
            "reward_std": float(pb.rewards.std()) if pb.rewards.numel() > 1 else 0.0,
            "degenerate_frac": float((pb.rewards.amax(1) == pb.rewards.amin(1)).float().mean()),
            "completion_len_mean": loss_tokens / max(n, 1),
            "tool_len_mean": (sum(completion) - loss_tokens) / max(n, 1),
            "trained_tokens": float(loss_tokens),
            "tool_tokens": float(sum(completion) - loss_tokens),
            "staleness_mean": float(np.mean(stale)),
            "staleness_max": float(np.max(stale)),
            "token_staleness_mean": float(np.mean(learner_version - vers)) if len(vers) else 0.0,
            "grad_norm": grad_norm,
            "lr": self.scheduler.get_last_lr()[0],
            "skipped_nonfinite": 0.0 if finite else 1.0,
            "train_s": train_s,
            "learner_processes": float(self.world),
            **self._throughput(pb, loss_tokens, train_s),
        })
        for s in stale:
            metrics[f"staleness_hist/{s}"] = metrics.get(f"staleness_hist/{s}", 0.0) + 1
        metrics.update(reward_means(groups))
        return metrics

    def _throughput(self, pb: PackedBatch, loss_tokens: int, seconds: float) -> dict[str, float]:
        """``learner_tokens`` (every token through the forward, prompts included, all ranks),
        ``learner_tokens_per_s`` and, on a GPU of known peak, ``mfu`` (pipeline.learner.flops)."""
        lengths = pb.lengths()
        out = {"learner_tokens": float(sum(lengths)),
               "learner_tokens_per_s": sum(lengths) / max(seconds, 1e-9)}
        if self._shape is not None and self._peak is not None:
            flops = train_flops(self._shape, lengths, loss_tokens)
            out["learner_tflops"] = flops / max(seconds, 1e-9) / 1e12
            out["mfu"] = flops / (max(seconds, 1e-9) * self._peak * self.world)
        return out

    # -------------------------------------------------------------- weights
    def _model_state(self) -> dict[str, torch.Tensor]:
        """The full (unwrapped) model state dict on rank 0, {} on the others. Under ZeRO-3 a
        collective: each layer's partitions are gathered in turn and copied to rank 0's CPU."""
        if self.rank != 0 and self.zero_stage != 3:
            return {}
        sd = self.accelerator.get_state_dict(self.policy) or {}
        return {k.removeprefix("model."): v for k, v in sd.items()}

    def snapshot_tensors(self) -> dict[str, torch.Tensor]:
        """Weights for producers, in the engines' dtype, HF names (tied lm_head left out).

        Only tensors that can change travel: trainable ones, or under LoRA the adapter alone
        (peft's saved names, ``sync.lora``) or, without adapter sync, the targeted modules'
        weights with the adapter merged in (W + scale * B @ A).
        """
        with self._lock:
            self._lead("snapshot")
            return self._snapshot()

    def _snapshot(self) -> dict[str, torch.Tensor]:
        sd = self._model_state()
        if not sd:  # a follower rank: rank 0 alone holds (and sends) the full weights
            return {}
        if self._lora and self.adapter_sync:
            return adapter_tensors(sd, list(self._lora), self.snapshot_dtype)
        if self._lora:
            merged = merge_lora(sd, self._lora, self.snapshot_dtype)
        else:
            trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
            merged = {k: v for k, v in sd.items() if k in trainable}
        return {k: v.detach().to(self.snapshot_dtype) for k, v in merged.items()
                if k not in self._skip}

    def _snapshot_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters a version carries (trainable, tied lm_head left out), in model order:
        the names and order ``_snapshot`` gives without LoRA."""
        return [(n, p) for n, p in self.model.named_parameters()
                if p.requires_grad and n not in self._skip]

    def snapshot_plan(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]] | None:
        """What ``snapshot_buckets`` yields, known without gathering anything: {HF name: (the
        engines' dtype, full shape)} in model order (ZeRO-3 parameters hold their full shape in
        ``ds_shape``). None under LoRA: its versions are computed from the whole gathered state
        (merged weights or the adapter), so they come from ``snapshot_tensors``."""
        if self._lora:
            return None
        return {n: (self.snapshot_dtype, tuple(int(s) for s in getattr(p, "ds_shape", p.shape)))
                for n, p in self._snapshot_params()}

    def snapshot_buckets(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """The weights of ``snapshot_plan``, one bucket at a time (``sync.packing.plan_buckets``:
        at most ``bucket_bytes`` of the engines' dtype each, a larger tensor alone), as
        {name: full tensor on the model's device, in the parameter's own dtype}.

        A bucket's tensors are valid only until the next one is asked for (under ZeRO-3 they
        are the gathered parameters, partitioned again when the bucket ends): copy them out
        (``copy_`` into a view of the plan's dtype casts) before advancing. Under ZeRO-3 each
        bucket is an all-gather that the other ranks run in step (the "buckets" command), so no
        rank holds more than a bucket of gathered weights beside its shards; the caller must run
        the generator to its end even when its own copy fails, or the other ranks wait for
        ever. Yields nothing on ranks other than 0."""
        with self._lock:
            if self.zero_stage == 3:
                self._lead("buckets", bucket_bytes)
            yield from self._snapshot_buckets(bucket_bytes)

    def _snapshot_buckets(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        params = dict(self._snapshot_params())
        layout = plan_layout_of({n: (self.snapshot_dtype,
                                     tuple(getattr(p, "ds_shape", p.shape)))
                                 for n, p in params.items()})
        for names in plan_buckets(layout, bucket_bytes):
            group = [params[n] for n in names]
            gather = contextlib.nullcontext()
            if self.zero_stage == 3:
                import deepspeed

                gather = deepspeed.zero.GatheredParameters(group, modifier_rank=None)
            with gather:
                if self.rank == 0:
                    yield {n: p.detach() for n, p in zip(names, group, strict=True)}

    # -------------------------------------------------------------- checkpoint state
    def state(self) -> dict[str, Any]:
        with self._lock:
            self._lead("state")
            return self._state()

    def _state(self) -> dict[str, Any]:
        common = {"scheduler": self.scheduler.state_dict(), "rng": torch.get_rng_state()}
        if self.deepspeed is not None:  # model and optimiser: every rank's, in save_shards()
            return {"deepspeed_zero_stage": self.zero_stage, **common}
        return {"model": self._model_state(), "optimizer": self.optimizer.state_dict(), **common}

    def save_shards(self, directory: Path) -> None:
        """Under DeepSpeed, every rank writes its partitions (optimiser state, and ZeRO-3
        parameters) into ``directory``/deepspeed: a collective; returns once all are written.
        Nothing to do otherwise (``state()`` holds everything)."""
        if self.deepspeed is None:
            return
        with self._lock:
            self._lead("save", str(directory))
            self._save_shards(str(directory))

    def _save_shards(self, directory: str) -> None:
        self.policy.save_checkpoint(str(Path(directory) / DEEPSPEED_DIR), tag=DEEPSPEED_TAG,
                                    client_state={}, save_latest=False)
        D.barrier()  # every rank's files are complete before rank 0 renames the directory

    def load_state(self, state: dict[str, Any], directory: Path | None = None) -> None:
        """Restore ``state()``; under DeepSpeed every rank also reads its partitions from the
        checkpoint ``directory``."""
        with self._lock:
            self._lead("load", state, None if directory is None else str(directory))
            self._load_state(state, None if directory is None else str(directory))

    def _load_state(self, state: dict[str, Any], directory: str | None = None) -> None:
        written_by_ds = "deepspeed_zero_stage" in state
        if written_by_ds != (self.deepspeed is not None):
            raise CheckpointError(
                f"checkpoint {directory} was written {'with' if written_by_ds else 'without'} "
                f"DeepSpeed; resume it with the same train.accelerate_config")
        if self.deepspeed is not None:
            if directory is None:
                raise CheckpointError("a DeepSpeed checkpoint needs its directory to load")
            loaded, _ = self.policy.load_checkpoint(
                str(Path(directory) / DEEPSPEED_DIR), tag=DEEPSPEED_TAG,
                load_optimizer_states=True, load_lr_scheduler_states=False)
            if loaded is None:
                raise CheckpointError(f"DeepSpeed could not load {directory}/{DEEPSPEED_DIR}")
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])

