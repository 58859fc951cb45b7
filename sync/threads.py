"""Blocking calls that may never return, run where they cannot hold the process: one daemon
thread per call, awaited through a future.

Not ``asyncio.to_thread``: its executor threads are not daemons and ``asyncio.run`` joins them
without limit at exit, so one hung call (a ``ncclCommInitRank`` whose peer died, a user's reward
or episode tool stuck past its timeout) would keep the process alive for good or hold a pool
slot forever. A daemon thread is simply abandoned. Used by the learner's NCCL links, the reward
runner's thread executor and episode tools.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any


def in_daemon_thread(fn: Callable[..., Any], *args: Any, name: str = "",
                     on_orphan: Callable[[Any], None] | None = None) -> asyncio.Future:
    """Run ``fn(*args)`` on a fresh daemon thread (named ``name``); await the returned future
    for its result or its exception. The awaiting side may give up (``wait_for``) at any time:
    a result that arrives after that goes to ``on_orphan`` (a late NCCL communicator is
    aborted rather than leaked), and one that arrives after the loop closed is dropped."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def orphan(value: Any) -> None:
        if on_orphan is not None:
            on_orphan(value)

    def settle(ok: bool, value: Any) -> None:
        if fut.done():  # given up meanwhile
            if ok:
                orphan(value)
        elif ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def body() -> None:
        try:
            ok, value = True, fn(*args)
        except BaseException as e:  # handed to the awaiting side
            ok, value = False, e
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop closed: nobody will ever take the result
            if ok:
                orphan(value)

    thread_name = name or f"daemon-{getattr(fn, '__name__', 'call')}"
    threading.Thread(target=body, name=thread_name, daemon=True).start()
    return fut
