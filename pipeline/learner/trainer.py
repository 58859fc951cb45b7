"""The policy and its optimiser: turns a batch of rollout groups into one GRPO optimiser step.

Synchronous torch code only (the learner runs it in a worker thread so that its event loop keeps
receiving groups). Owns: the optimiser step (micro-batched forward/backward with gradient
accumulation, clipping, the non-finite-step guard, the scheduler), the step's metrics, the
weights that go into snapshots, and the trainer's checkpoint state. Around it: the model, the
accelerator and DeepSpeed's config are built by ``pipeline.learner.build``; batch layouts and
micro-batch plans are ``pipeline.learner.batching``; the per-token logprobs of a micro-batch
(chunked head, on-grid placement) are ``pipeline.learner.logprobs``; the loss is
``pipeline.learner.loss``; the batch's numbers and throughput are
``pipeline.learner.step_metrics``; LoRA is merged into plain HF names by
``pipeline.learner.lora``, so vLLM loads it as full weights.

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

Under FSDP2 (``train.fsdp2``, ``pipeline.learner.fsdp``) the policy is sharded by
``fully_shard`` instead of prepared by the accelerator; as under ZeRO-3 every rank runs the same
number of micro-batches, snapshots gather the shards (a collective) and ``save_shards`` writes
every rank's weights and AdamW state (torch.distributed.checkpoint).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from buffer.schema import RolloutGroup
from pipeline.config import RunConfig
from pipeline.learner import distributed as D
from pipeline.learner import fsdp
from pipeline.learner.attention import register as register_varlen
from pipeline.learner.batching import PackedBatch, pack_groups, plan_micro_batches
from pipeline.learner.build import (
    autocast,
    configure_deepspeed,
    load_policy_model,
    make_accelerator,
    reference_model,
)
from pipeline.learner.checkpoint import (
    DEEPSPEED_DIR,
    DEEPSPEED_TAG,
    CheckpointError,
    failure_text,
    tensor_bytes,
)
from pipeline.learner.flops import ModelShape, peak_flops
from pipeline.learner.logprobs import Policy, device_batch, micro_batch_logprobs
from pipeline.learner.lora import merge_lora
from pipeline.learner.loss import grpo_loss
from pipeline.learner.oom import step_with_retry
from pipeline.learner.optim import make_adamw
from pipeline.learner.step_metrics import batch_metrics, reward_means, staleness_hist, throughput
from sync.lora import adapter_tensors
from sync.packing import plan_buckets, plan_layout_of

log = logging.getLogger(__name__)


class PolicyTrainer:
    """One learner rank's policy, optimiser and reference: ``step`` trains on a batch of
    groups, ``snapshot_*`` give the weights a version carries, ``state``/``load_state``/
    ``save_shards`` its checkpoint; rank 0 calls them, the other ranks ``follow()``."""

    def __init__(self, cfg: RunConfig, model_path: str, device: str | None = None):
        from transformers import AutoTokenizer

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
            self.zero_stage = configure_deepspeed(self.deepspeed.deepspeed_config, t, self.world)
        self.fsdp2 = t.fsdp2
        if self.fsdp2 and (self.deepspeed is not None or not D.is_distributed()):
            raise ValueError("train.fsdp2 needs a multi-process learner without DeepSpeed "
                             "(train.learner_processes >= 2, no train.accelerate_config)")
        self._lock = threading.Lock()  # a command and its collectives are never interleaved
        # Called before each optimiser step changes the parameters: a checkpoint's copy of them
        # may still be in flight (CheckpointWriter.fence).
        self.before_update: Callable[[], None] | None = None
        self._released = False
        # fp32 master weights; bf16 autocast on GPUs (CPU autocast is slower than fp32 here);
        # DeepSpeed with bf16 keeps bf16 weights and fp32 masters in the optimiser partitions.
        # Packed rows need attention that stays inside each sequence (pipeline.learner.attention).
        self.attn = {"attn_implementation": register_varlen()} if t.packing else {}
        # A LoRA base is frozen: on a GPU it stays in model.dtype (no fp32 master weights).
        base = getattr(torch, cfg.model.dtype) if cuda and t.lora_rank else torch.float32
        self.model, self._lora = load_policy_model(model_path, t, self.attn, base)
        # Adapter sync: each version ships the LoRA tensors alone (sync.lora). The producers
        # read the same plan, decided once by the launcher, so both sides agree on what a
        # snapshot holds.
        self.adapter_sync = cfg.adapter_plan.adapter_only
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        self._build_optimizer(cuda)
        self.ref_model = None
        if t.loss.kl_coef > 0:
            self.ref_model = reference_model(
                model_path, self.attn, t.logprob_chunk,
                torch.device("cpu") if self.fsdp2 else self.device,
                self.deepspeed.deepspeed_config if self.zero_stage == 3 else None)
            if self.fsdp2:  # as large as the policy: sharded like it (onto the device)
                self.ref_model = fsdp.shard(self.ref_model, self.ref_model.model, self.device,
                                            self._bf16, reshard_root=True)
        self.snapshot_dtype = getattr(torch, cfg.model.dtype)
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        self._skip = {"lm_head.weight"} if tied else set()
        self._shape, self._peak = None, None  # for the mfu metric (pipeline.learner.flops)
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            self._shape = ModelShape.from_config(self.model.config)
        if self.device.type == "cuda":
            self._peak = peak_flops(torch.cuda.get_device_name(self.device))

    @property
    def sharded(self) -> bool:
        """Weights are sharded over the ranks (ZeRO-3 or FSDP2): reading them is a collective."""
        return self.zero_stage == 3 or self.fsdp2

    @property
    def has_shards(self) -> bool:
        """Checkpoints need every rank's files (``save_shards``): DeepSpeed or FSDP2."""
        return self.deepspeed is not None or self.fsdp2

    @property
    def _bf16(self) -> bool:
        return self.cfg.model.dtype == "bfloat16"

    def _build_optimizer(self, cuda: bool) -> None:
        """AdamW over the trainable parameters, its warm-up scheduler, and the model and
        optimiser prepared by the accelerator (``self.policy``: the logprob forward); under
        FSDP2 the policy is sharded first and the optimiser holds the shards."""
        t = self.cfg.train
        if self.fsdp2:
            # fully_shard moves the model to the mesh's device, layer by layer.
            self.policy = fsdp.shard(Policy(self.model, t.logprob_chunk), self.model,
                                     self.device, self._bf16)
        params = [p for p in self.model.parameters() if p.requires_grad]
        # One fused kernel for the whole update on a GPU (DeepSpeed keeps its own partitions;
        # fused AdamW takes FSDP2's sharded parameters as they are).
        fused = cuda and self.deepspeed is None
        optimizer = make_adamw(params, t.optimizer_lr, t.weight_decay, t.optimizer_state, fused)
        warm = max(t.warmup_steps, 0)
        # The scheduler stays outside accelerate: it steps once per optimiser step, not per rank.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        if self.fsdp2:
            self.optimizer = optimizer
            return
        self.policy, self.optimizer = self.accelerator.prepare(
            Policy(self.model, t.logprob_chunk), optimizer)

    @property
    def vocab_size(self) -> int:
        """Token ids the model can embed and score: [0, vocab_size)."""
        rows = self.model.get_input_embeddings().num_embeddings
        return min(int(getattr(self.model.config, "vocab_size", rows) or rows), int(rows))

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
            if op == "save":
                try:
                    self._save_shards(*args)
                except CheckpointError as e:  # every rank raised it; rank 0 reports it
                    log.info("rank %d: checkpoint shards not kept: %s", self.rank, e)
                continue
            {"grads": self._accumulate, "snapshot": self._snapshot, "state": self._state,
             "load": self._load_state}[op](*args)

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
            # An OOM retries the batch at half the micro-batch tokens (pipeline.learner.oom).
            return step_with_retry(self, lambda: self._step(groups, learner_version),
                                   [len(g.prompt_token_ids) + len(c.token_ids) for g in groups
                                    for c in g.completions])

    def accumulate_gradients(self, groups: list[RolloutGroup]) -> dict[str, float]:
        """Forward/backward only: leaves the (rank-averaged) gradients of the batch loss in
        ``.grad`` (for tests and debugging); returns the loss metrics. Not under DeepSpeed,
        whose gradients live in ZeRO partitions until its ``step()``, nor FSDP2 (sharded)."""
        if self.deepspeed is not None or self.fsdp2:
            raise NotImplementedError("accumulate_gradients under DeepSpeed or FSDP2")
        with self._lock:
            self._lead("grads", groups)
            return self._accumulate(groups)[1]

    def _plan(self, pb: PackedBatch, rank: int) -> list[list[int]]:
        """Rank ``rank``'s micro-batches: its slice of the completions, by rows or tokens."""
        t = self.cfg.train
        mine = D.shard_rows(len(pb.sequences), rank, self.world)
        return plan_micro_batches(pb.lengths(), mine, t.micro_batch, t.micro_batch_tokens,
                                  t.packing)

    def _micro_batches(self, pb: PackedBatch) -> list[tuple[list[int], float]]:
        """This rank's micro-batches as (rows, weight of its loss). A rank without rows still
        runs one zero-weighted backward: DDP/ZeRO reductions are collectives that every rank
        must enter; under DeepSpeed and FSDP2 every rank runs as many as the busiest one
        (ZeRO-2/3 and FSDP2 communicate in every backward, ZeRO-3 and FSDP2 in every forward)."""
        chunks = [(rows, 1.0) for rows in self._plan(pb, self.rank)] or [([0], 0.0)]
        if self.deepspeed is not None or self.fsdp2:
            most = max(len(self._plan(pb, r)) for r in range(self.world))
            chunks += [([0], 0.0)] * (most - len(chunks))
        return chunks

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
        chunks = self._micro_batches(pb)
        ds = self.deepspeed is not None
        self.optimizer.zero_grad(set_to_none=True)
        acc: dict[str, torch.Tensor] = {}
        bad = torch.zeros((), dtype=torch.bool, device=self.device)
        # One autocast region for the whole step: autocast casts each fp32 weight to bf16 once
        # and caches it while the region lasts, instead of once per micro-batch.
        with autocast(self.cfg.model.dtype, self.device):
            for ci, (rows, keep) in enumerate(chunks):
                b, attention = device_batch(pb, rows, self.cfg.train.packing, self.pad_id,
                                            self.device)
                last = ci == len(chunks) - 1
                if ds:
                    self.policy.set_gradient_accumulation_boundary(last)
                # FSDP2 reduce-scatters every micro-batch's gradients (as ZeRO does):
                # skipping it would hold full fp32 gradients until the last one.
                sync = contextlib.nullcontext() if last or ds or self.fsdp2 else \
                    self.accelerator.no_sync(self.policy)
                with sync:
                    lp, ref = micro_batch_logprobs(self.policy, self.ref_model, b, attention)
                    out = grpo_loss(lp, b["behaviour"], b["advantages"], b["mask"].float(), lc,
                                    ref_logprobs=ref,
                                    normalizer=normalizer if lc.agg == "token_mean" else
                                    float(len(pb.sequences)), tensor_metrics=True)
                    # A non-finite loss is back-propagated anyway (the update is skipped after all
                    # micro-batches): ranks stay in step and DeepSpeed reaches its boundary.
                    bad = bad | ~torch.isfinite(out.loss.detach())
                    self._backward(out.loss, keep)
                if keep:
                    _add_loss_metrics(acc, out.metrics, b["mask"].sum() / normalizer)
        keys = sorted(acc)
        values = torch.stack([acc[k].float() for k in keys] + [bad.float()]).tolist()
        finite = values.pop() == 0.0
        return pb, D.sum_dicts(dict(zip(keys, values, strict=True))), finite, loss_tokens

    def _backward(self, loss: torch.Tensor, keep: float) -> None:
        """Back-propagate a micro-batch's ``loss`` weighted by ``keep``. Gradient reduction
        averages over ranks; the loss is a sum over the global batch, so undo the 1/world."""
        if self.deepspeed is not None:  # not accelerator.backward: under DeepSpeed it steps
            self.policy.backward(loss * (keep * self.world))
        elif self.fsdp2:  # reduce-scatter averages over ranks, as DDP's all-reduce
            (loss * (keep * self.world)).backward()
        else:
            self.accelerator.backward(loss * (keep * self.world))

    def _update(self, finite: bool) -> tuple[bool, float]:
        """Clip and apply the accumulated gradients unless any rank's loss or the gradient norm
        is not finite; returns (applied, gradient norm)."""
        grad_norm = math.nan
        if self.before_update is not None:
            self.before_update()
        if self.deepspeed is not None:
            finite = D.all_true(finite, self.device)
            # Clips (train.grad_clip) and skips an update whose gradient norm is not finite.
            self.policy.step()
            norm = self.policy.get_global_grad_norm()
            grad_norm = float(norm) if norm is not None else math.nan
            finite = finite and self.policy.was_step_applied()
            if finite:
                self.scheduler.step()
            return finite, grad_norm
        if finite or self.world > 1:
            clip = self.cfg.train.grad_clip
            params = [p for p in self.policy.parameters() if p.requires_grad]
            clip = clip if clip > 0 else float("inf")
            if self.fsdp2:  # the norm over every rank's shards (a DTensor)
                norm = torch.nn.utils.clip_grad_norm_(params, clip)
                grad_norm = float(fsdp.full_tensor(norm))
            else:
                grad_norm = float(self.accelerator.clip_grad_norm_(params, clip))
            finite = finite and math.isfinite(grad_norm)
        finite = D.all_true(finite, self.device)
        if finite:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return finite, grad_norm

    def _step(self, groups: list[RolloutGroup], learner_version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        pb, acc, finite, loss_tokens = self._accumulate(groups)
        finite, grad_norm = self._update(finite)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # train_s covers the queued optimiser kernels
        train_s = time.perf_counter() - t0
        metrics = {f"loss/{k}": v for k, v in acc.items()}
        metrics.update(batch_metrics(pb, groups, loss_tokens, learner_version))
        metrics.update({
            "grad_norm": grad_norm,
            "lr": self.scheduler.get_last_lr()[0],
            "skipped_nonfinite": 0.0 if finite else 1.0,
            "train_s": train_s,
            "learner_processes": float(self.world),
            **throughput(pb, loss_tokens, train_s, self._shape, self._peak, self.world),
        })
        metrics.update(staleness_hist(groups, learner_version))
        metrics.update(reward_means(groups))
        return metrics

    # -------------------------------------------------------------- weights
    def _model_state(self) -> dict[str, torch.Tensor]:
        """The full (unwrapped) model state dict on rank 0, {} on the others. Under ZeRO-3 and
        FSDP2 a collective: the shards are gathered in turn and copied to rank 0's CPU."""
        if self.rank != 0 and not self.sharded:
            return {}
        if self.fsdp2:
            sd = fsdp.full_state(self.policy)
        elif self.deepspeed is not None:
            sd = self.accelerator.get_state_dict(self.policy) or {}
        else:  # not accelerate's unwrap_model: it imports DeepSpeed (seconds) to test for it
            sd = _unwrap(self.policy).state_dict()
        if self.rank != 0:
            return {}
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
            if self.sharded:
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
                if self.fsdp2:  # one all-gather per parameter, every rank in turn
                    full = [fsdp.full_tensor(p.detach()) for p in group]
                    if self.rank == 0:
                        yield dict(zip(names, full, strict=True))
                    del full
                elif self.rank == 0:
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
        if self.fsdp2:  # likewise: every rank's shards, in save_shards()
            return {"fsdp2_ranks": self.world, **common}
        return {"model": self._model_state(), "optimizer": self.optimizer.state_dict(), **common}

    def checkpoint_plan(self) -> tuple[int, int, bool]:
        """(bytes, tensors, on a GPU) of ``state()``'s tensors once the optimiser has stepped:
        the model state, and AdamW's two moments and step count per trainable parameter (its
        state is still empty before the first step, when the staging buffers are allocated).
        (0, 0, False) under DeepSpeed or FSDP2, whose ranks write their shards themselves."""
        if self.has_shards:
            return 0, 0, False
        nbytes, count, cuda = tensor_bytes(self.model.state_dict())
        for p in self.model.parameters():
            if p.requires_grad:
                nbytes += 2 * p.numel() * p.element_size() + 8
                count += 3
        return nbytes, count, cuda

    def save_shards(self, directory: Path) -> None:
        """Under DeepSpeed, every rank writes its partitions (optimiser state, and ZeRO-3
        parameters) into ``directory``/deepspeed; under FSDP2 its shards of the weights and
        the AdamW state into ``directory``/fsdp: a collective; returns once all are written.
        Nothing to do otherwise (``state()`` holds everything)."""
        if not self.has_shards:
            return
        with self._lock:
            self._lead("save", str(directory))
            self._save_shards(str(directory))

    def _save_shards(self, directory: str) -> None:
        """This rank's files, then every rank learns every rank's outcome (a collective in
        place of a barrier: every rank's files are complete before rank 0 renames the
        directory). A rank whose write fails (a full disk: DeepSpeed's ``torch.save`` raises
        RuntimeError, DCP a CheckpointException, which is a BaseException) still runs every
        collective the others run, so no rank waits in one that another skipped; then every
        rank raises the same CheckpointError (followers log it and go on following)."""
        error: str | None = None
        try:
            if self.fsdp2:  # DCP raises the same failure on every rank
                fsdp.save(self.policy, self.optimizer, Path(directory))
            else:
                with _write_failures_kept(self.policy) as failures:
                    self.policy.save_checkpoint(str(Path(directory) / DEEPSPEED_DIR),
                                                tag=DEEPSPEED_TAG, client_state={},
                                                save_latest=False)
                error = failures[0] if failures else None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException is one
            error = failure_text(e)
        failed = [(r, e) for r, e in enumerate(D.gather_objects(error)) if e is not None]
        if failed:
            raise CheckpointError("; ".join(f"rank {r}: {e}" for r, e in failed))

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
        written_ranks = state.get("fsdp2_ranks")
        if (written_ranks is not None) != self.fsdp2 or written_ranks not in (None, self.world):
            raise CheckpointError(
                f"checkpoint {directory} was written with "
                f"{f'train.fsdp2 over {written_ranks} ranks' if written_ranks else 'no FSDP2'}; "
                f"resume it with the same train.fsdp2 and train.learner_processes")
        if self.fsdp2:
            if directory is None:
                raise CheckpointError("an FSDP2 checkpoint needs its directory to load")
            fsdp.load(self.policy, self.optimizer, Path(directory))
        elif self.deepspeed is not None:
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


@contextlib.contextmanager
def _write_failures_kept(engine: Any) -> Iterator[list[str]]:
    """DeepSpeed's ``save_checkpoint`` runs collectives between its writes (barriers, the tag
    check): a rank whose write raised would leave the others waiting in the next one. Inside
    this block the engine's writes (its checkpoint engine's ``makedirs`` and ``save``, the
    recovery script's copy) keep their failures in the yielded list instead of raising, so
    every rank runs the same collectives; the caller reports them."""
    failures: list[str] = []

    def kept(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                failures.append(failure_text(e))
                return None
        return call

    writer = getattr(engine, "checkpoint_engine", None)
    targets = [(writer, "makedirs"), (writer, "save"), (engine, "_copy_recovery_script")]
    patched = []
    for obj, name in targets:
        if callable(getattr(obj, name, None)) and name not in vars(obj):
            setattr(obj, name, kept(getattr(obj, name)))
            patched.append((obj, name))
    try:
        yield failures
    finally:
        for obj, name in patched:
            delattr(obj, name)


def _add_loss_metrics(acc: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor],
                      weight: torch.Tensor) -> None:
    """Add a micro-batch's loss metrics into the batch's ``acc``: ``loss`` summed (each
    micro-batch's is already over the batch normaliser), ``*_max`` the largest over the batch,
    the others as means weighted by the micro-batch's share ``weight`` of the loss tokens."""
    for k, v in metrics.items():
        if k.endswith("_max"):  # the largest over the batch, not a mean
            acc[k] = torch.maximum(acc[k], v) if k in acc else v
        else:
            acc[k] = acc.get(k, 0.0) + v * (1.0 if k == "loss" else weight)


def _unwrap(policy: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP (multi-process) and ``torch.compile`` wrappers."""
    inner = policy.module if isinstance(policy, torch.nn.parallel.DistributedDataParallel) \
        else policy
    return getattr(inner, "_orig_mod", inner)
