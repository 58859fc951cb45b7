"""What every process of a run does the same way: logging setup, and running its main
coroutine so that SIGTERM cancels it (its ``finally`` blocks then run: checkpoints, engine
shutdown). Shared by the launcher's children and the accelerate-launched learner ranks."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from typing import Any


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(processName)s %(name)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("vllm", "transformers", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


async def run_with_sigterm(coro: Any) -> None:
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    await task


def wait_group_gone(pgid: int | None, timeout: float = 10.0) -> None:
    """Wait until no process of group ``pgid`` (a child and what it started) is left."""
    deadline = time.monotonic() + timeout
    while pgid is not None and time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.1)
