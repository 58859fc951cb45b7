"""Rank plumbing for a learner started by ``accelerate launch`` (WORLD_SIZE > 1).

Rank 0 is the learner proper: it alone does I/O (ZeroMQ endpoint, buffer, announces, snapshots,
checkpoints, metrics). Every other rank is a follower that only trains: rank 0 broadcasts each
command (a batch to train on, "gather the weights", ...) and all ranks run it together, so every
collective (DDP all-reduce, ZeRO gathers) is entered by every rank in the same order.

Objects go through ``torch.distributed.broadcast_object_list`` (pickle): rank-to-rank inside one
job, never network input. With one process every function here is a no-op.
"""

from __future__ import annotations

import os
from typing import Any


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    """Rank 0 (or a single process): the one that does I/O."""
    return rank() == 0


def is_distributed() -> bool:
    import torch.distributed as dist

    return world_size() > 1 and dist.is_available() and dist.is_initialized()


def broadcast_object(obj: Any = None) -> Any:
    """Rank 0's ``obj`` on every rank (others pass None)."""
    if not is_distributed():
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_batch(groups: list | None) -> list:
    """Rank 0's batch of RolloutGroups on every rank."""
    return broadcast_object(groups)


def shard_rows(n: int, rank_: int | None = None, world: int | None = None) -> list[int]:
    """This rank's contiguous slice of ``n`` completions (sizes differ by at most one)."""
    r = rank() if rank_ is None else rank_
    w = world_size() if world is None else world
    base, extra = divmod(n, w)
    start = r * base + min(r, extra)
    return list(range(start, start + base + (1 if r < extra else 0)))


def sum_dicts(d: dict[str, float]) -> dict[str, float]:
    """Per-key sum of every rank's ``d`` (keys may differ between ranks); keys ending in
    ``_max`` take the largest value instead."""
    if not is_distributed():
        return d
    import torch.distributed as dist

    parts: list[Any] = [None] * world_size()
    dist.all_gather_object(parts, d)
    out: dict[str, float] = {}
    for p in parts:
        for k, v in p.items():
            out[k] = max(out[k], v) if k.endswith("_max") and k in out else out.get(k, 0.0) + v
    return out


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` with one process)."""
    if not is_distributed():
        return [obj]
    import torch.distributed as dist

    parts: list[Any] = [None] * world_size()
    dist.all_gather_object(parts, obj)
    return parts


def shutdown() -> None:
    """Tear the process group down before the interpreter exits: left to the C++ destructors at
    exit, a rank of a gloo group can abort ("terminate called without an active exception")
    after its work is done, and the launcher sees a failed learner."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    """Every rank has reached this point (no-op with one process)."""
    if is_distributed():
        import torch.distributed as dist

        dist.barrier()


def all_true(flag: bool, device: Any = "cpu") -> bool:
    """True only if ``flag`` is true on every rank (the non-finite guard must agree)."""
    if not is_distributed():
        return flag
    import torch
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())
