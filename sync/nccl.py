"""One NCCL link between the learner (rank 0) and one producer's vLLM workers (ranks 1..TP).

Built on vLLM's ``PyNcclCommunicator`` (same class and call in vLLM 0.25 and 0.32), but without
vLLM's TCPStore rendezvous: ``StatelessProcessGroup.broadcast_obj`` pickles the NCCL unique id
through the store, and this project unpickles nothing received from a socket. Here the learner
draws the 128-byte unique id, it travels as bytes in the msgpack Announce, and every rank hands
it to the communicator through ``_KnownIdGroup`` (no store at all).

Every wait is bounded: a broadcast is posted on a side stream and its completion event polled
until a deadline; on timeout the communicator is aborted (``ncclCommAbort`` through vLLM's
``destroy``) so the posted kernel cannot hang the GPU stream, and the link is dead (a new link,
new epoch, is built for the next version). ``ncclCommInitRank`` itself cannot be bounded; the
learner only calls it once the producer has said it is joining (``sync.routes.nccl``, whose
docstring maps the whole route: both ends, the worker calls, this communicator).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

UNIQUE_ID_BYTES = 128


class LinkError(RuntimeError):
    """A NCCL link could not be built, or a transfer on it failed or timed out (link aborted)."""


class NcclUnavailable(LinkError):
    """This process cannot build NCCL links at all (no libnccl): retrying will not help."""


def new_unique_id() -> bytes:
    """A fresh NCCL unique id (rank 0 only; needs libnccl)."""
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

    uid = NCCLLibrary().ncclGetUniqueId()
    return bytes(uid.internal)


def unique_id_from_bytes(data: bytes) -> Any:
    from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId

    if not isinstance(data, bytes) or len(data) != UNIQUE_ID_BYTES:
        raise LinkError(f"NCCL unique id must be {UNIQUE_ID_BYTES} bytes, got "
                        f"{len(data) if isinstance(data, bytes) else type(data).__name__}")
    uid = ncclUniqueId()
    for i, b in enumerate(data):
        uid.internal[i] = b if b < 128 else b - 256  # c_byte is signed
    return uid


def _known_id_group(rank: int, world_size: int, uid: Any) -> Any:
    from vllm.distributed.utils import StatelessProcessGroup

    class _KnownIdGroup(StatelessProcessGroup):
        """A StatelessProcessGroup whose only exchange, the unique id, is already known."""

        def broadcast_obj(self, obj: Any, src: int) -> Any:
            return uid

    return _KnownIdGroup(rank=rank, world_size=world_size, store=None)  # type: ignore[arg-type]


@contextlib.contextmanager
def keep_current_stream(device: torch.device | int, *, get: Any = None, put: Any = None):
    """Restore this thread's current CUDA stream on exit.

    vLLM's ``current_stream()`` (called by PyNcclCommunicator's constructor) sets a fresh
    non-blocking stream as the calling thread's current stream the first time a thread calls it,
    for good. On the learner that thread is a pooled worker thread that later runs a training
    step or a snapshot copy: its kernels would run unordered with the other threads' default
    stream, and a snapshot could read half-updated weights. ``get``/``put`` are for tests."""
    get = get or torch.cuda.current_stream
    put = put or (lambda s: torch.cuda.set_stream(s))  # vLLM patches set_stream: late lookup
    prev = get(device)
    try:
        yield
    finally:
        put(prev)


def connect(unique_id: bytes, rank: int, world_size: int, device: torch.device | int) -> Any:
    """Join the link as ``rank`` (blocks until all ranks have joined).

    On rank 0 vLLM's constructor also draws a unique id of its own that we then replace, which
    leaves one idle NCCL bootstrap thread and listening socket per link in this process (links
    are made once per producer, and again only after a failure)."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

    group = _known_id_group(rank, world_size, unique_id_from_bytes(unique_id))
    with keep_current_stream(device):
        comm = PyNcclCommunicator(group, device=device)
    if comm.disabled:
        raise NcclUnavailable("NCCL is not available in this process (no libnccl, or world "
                              "size 1)")
    return comm


def abort(comm: Any) -> None:
    """Abort a communicator (never raises; vLLM bounds the abort call itself)."""
    if comm is None:
        return
    with contextlib.suppress(Exception):  # an abort must not mask the error behind it
        comm.destroy()


def timed_broadcast(comm: Any, tensor: torch.Tensor, *, deadline: float, what: str) -> None:
    """Broadcast from rank 0 into/out of ``tensor``; abort ``comm`` and raise if it does not
    complete before ``deadline`` (time.monotonic)."""
    if getattr(comm, "disabled", False):  # aborted (a drop, a restart): vLLM would do nothing
        raise LinkError(f"NCCL {what}: the link was aborted")
    stream = torch.cuda.Stream(device=tensor.device)
    stream.wait_stream(torch.cuda.current_stream(tensor.device))
    with torch.cuda.stream(stream):
        comm.broadcast(tensor, src=0, stream=stream)
        done = torch.cuda.Event()
        done.record(stream)
    tensor.record_stream(stream)
    while not done.query():
        if time.monotonic() > deadline:
            abort(comm)
            raise LinkError(f"NCCL {what} did not complete in time; link aborted")
        time.sleep(0.0005)
    if getattr(comm, "disabled", False):  # aborted while in flight: nothing reliable arrived
        raise LinkError(f"NCCL {what}: the link was aborted during the transfer")
