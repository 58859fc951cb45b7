"""A training step that runs out of GPU memory is retried at half the micro-batch tokens.

Why: the memory plan (``pipeline.memory_plan``) is an estimate, and a batch of unusually long
completions can still exceed it. Dropping the batch loses its groups and, as every later batch is
as large, the run dies of the same OOM ten times over; the batch itself fits in smaller
micro-batches (gradient accumulation gives the same update). So: the step's partial gradients
are dropped, the cached blocks freed, ``train.micro_batch_tokens`` halved for this and every
later step, and the same batch is trained again (halved again while it still runs out); once it
is trained, one warning line names the new value and the option that starts there. Below the
floor (one sequence per micro-batch) nothing smaller exists: ``MemoryFloorError``, one line, and
the learner stops.

Only a single-process learner without DeepSpeed retries: under several ranks a retry on one rank
alone would leave the others waiting in a collective, so there the error propagates as before.

Test hook: ``PIPELINE_TEST_OOM_ABOVE_TOKENS=N`` raises ``torch.OutOfMemoryError`` at the start of
any step whose largest micro-batch holds more than N tokens (a card that fits N), so a CPU test
sees the retry and the floor without a GPU.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from pipeline.learner.batching import plan_micro_batches

log = logging.getLogger(__name__)
INJECT_ENV = "PIPELINE_TEST_OOM_ABOVE_TOKENS"


class MemoryFloorError(RuntimeError):
    """Out of GPU memory with one sequence per micro-batch: no smaller step exists."""


def micro_batch_tokens(lengths: list[int], micro_batch: int, budget: int, packed: bool) -> int:
    """Tokens of the largest micro-batch the trainer's plan makes for sequences of ``lengths``
    (padded rows count rows x longest, as ``plan_micro_batches`` does)."""
    rows = list(range(len(lengths)))
    plans = plan_micro_batches(lengths, rows, micro_batch, budget, packed)
    cost = [sum(lengths[r] for r in mb) if packed else len(mb) * max(lengths[r] for r in mb)
            for mb in plans]
    return max(cost, default=0)


def halved(largest: int, longest: int) -> int | None:
    """The next token budget after an OOM with a largest micro-batch of ``largest`` tokens; None
    below the floor (a micro-batch of one ``longest`` sequence cannot shrink)."""
    if largest <= longest:
        return None
    return max(largest // 2, longest)


def inject_oom(largest: int) -> None:
    """The test hook (module docstring): raise as a card that fits N tokens would."""
    limit = os.environ.get(INJECT_ENV)
    if limit and largest > int(limit):
        raise torch.OutOfMemoryError(f"injected by {INJECT_ENV}={limit}: a micro-batch of "
                                     f"{largest} tokens")


def step_with_retry(trainer: Any, step: Callable[[], dict[str, float]],
                    lengths: list[int]) -> dict[str, float]:
    """``step()`` (one optimiser step of the trainer on a batch whose sequences have
    ``lengths``), retried at half the micro-batch tokens after each OOM; the metrics gain
    ``oom_retries`` and, on a GPU, the learner's peak memory (``mem_peak_gb``: the allocator's
    reserved bytes, ``mem_alloc_peak_gb``: allocated) since the step began."""
    t = trainer.cfg.train
    cuda = trainer.device.type == "cuda"
    retry_ok = trainer.world == 1 and trainer.deepspeed is None and not trainer.fsdp2
    if cuda:
        torch.cuda.reset_peak_memory_stats(trainer.device)
    retries, first = 0, 0
    while True:
        largest = micro_batch_tokens(lengths, t.micro_batch, t.micro_batch_tokens, t.packing)
        try:
            inject_oom(largest)
            metrics = step()
            break
        except torch.OutOfMemoryError as e:
            if not retry_ok:
                raise
            reason = str(e).splitlines()[0][:200] if str(e) else "out of memory"
        # Outside the except block: the traceback's frames hold the step's tensors until here.
        trainer.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        new = halved(largest, max(lengths, default=1))
        if new is None:
            raise MemoryFloorError(
                f"learner: out of GPU memory with one sequence ({largest} tokens) per "
                f"micro-batch, the floor ({reason}); stopping. Lower "
                f"engine.gpu_memory_utilization, set train.gradient_checkpointing true, or "
                f"train with LoRA (train.lora_rank)")
        t.micro_batch_tokens = new
        retries, first = retries + 1, first or largest
    if retries:  # one line for the step, however many halvings it took
        n = t.micro_batch_tokens
        log.warning("learner: out of GPU memory in a step with micro-batches of up to %d "
                    "tokens; the same batch was retried and trained at train.micro_batch_tokens "
                    "%d (%d halving%s; set --train.micro_batch_tokens %d to start there)",
                    first, n, retries, "" if retries == 1 else "s", n)
    metrics["oom_retries"] = float(retries)
    metrics["micro_batch_tokens"] = float(t.micro_batch_tokens)
    if cuda:
        metrics["mem_peak_gb"] = torch.cuda.max_memory_reserved(trainer.device) / 1e9
        metrics["mem_alloc_peak_gb"] = torch.cuda.max_memory_allocated(trainer.device) / 1e9
    return metrics
