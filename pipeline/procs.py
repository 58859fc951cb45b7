"""What every process of a run does the same way: its output into its log file, logging setup,
and running its main coroutine so that SIGTERM cancels it (its ``finally`` blocks then run:
checkpoints, engine shutdown). Shared by the launcher's children and the accelerate-launched
learner ranks.

Each process of a run writes everything it prints to ``run_dir/logs/<process>.log``
(``to_log_file``): its own log records, vLLM's and other libraries', the output of the processes
it starts (vLLM's engine core inherits the file), raw tracebacks. The launcher follows those
files and alone writes to the console (``pipeline.launch.console``). Lines meant for the user
(progress, the summary) are records of the ``CONSOLE`` logger.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

LOG_FORMAT = "%(asctime)s %(processName)s %(name)s %(levelname)s %(message)s"
LOG_DATEFMT = "%H:%M:%S"
CONSOLE = "pipeline.console"
"""Logger of the lines a run shows on the console whatever the level (progress, summary)."""
LOGS_DIR = "logs"
ENGINE_SHUTDOWN = "engine shutdown: requests aborted, stopping the engine core and its workers"
"""A producer's record as it shuts its engine down: library errors after it in its log file, up
to the next ``ENGINE_START`` (a restarted producer), are that shutdown's, kept from the console
but for one line (``pipeline.launch.console``)."""
ENGINE_START = "starting vLLM"
"""How the record that starts an engine begins (``pipeline.producer.engine.build_engine``)."""


def log_file(run_dir: str | Path, process: str) -> Path:
    """``run_dir/logs/<process>.log`` (process: launcher, learner, producer-0, ...)."""
    return Path(run_dir) / LOGS_DIR / f"{process}.log"


def to_log_file(path: Path) -> None:
    """Point this process's stdout and stderr (file descriptors 1 and 2, so that the processes
    it starts inherit them) at ``path``, appended to: a restarted process continues its file,
    and the lines of a process and of its children interleave whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)  # the launcher follows the file as it grows


class ConsoleStream:
    """A text stream whose lines become ``CONSOLE`` records: ``print(..., file=ConsoleStream())``
    reaches the run's console (through the launcher) and the process's log file."""

    def __init__(self) -> None:
        self._log = logging.getLogger(CONSOLE)
        self._buf = ""

    def write(self, text: str) -> int:
        self._buf += text
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            self._log.info("%s", line)
        return len(text)

    def flush(self) -> None:
        pass


def die_with_parent() -> None:
    """Linux: get SIGTERM when the parent dies (even by kill -9), so no child is orphaned."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def child_setup(run_dir: str, process: str, log_to_file: bool) -> None:
    """What a role process started by a launcher does first: its own process group (stopping
    it stops what it started: vLLM's engine-core processes), SIGTERM when the launcher dies
    (even by kill -9, so no child is orphaned), its output into ``run_dir/logs/<process>.log``
    when ``log_to_file`` (the launcher shows what is for the console), logging, and a SIGINT
    that raises KeyboardInterrupt (the launcher decides who stops and in which order)."""
    os.setpgrp()
    die_with_parent()
    if log_to_file:
        to_log_file(log_file(run_dir, process))
    setup_logging()
    signal.signal(signal.SIGINT, signal.default_int_handler)


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, stream=sys.stderr, format=LOG_FORMAT, datefmt=LOG_DATEFMT)
    logging.captureWarnings(True)  # warnings.warn as WARNING records (the console shows them)
    for noisy in ("transformers", "httpx"):
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
