"""What every process of a run does the same way: its output into its log file, logging setup,
and running its main coroutine so that SIGTERM cancels it (its ``finally`` blocks then run:
checkpoints, engine shutdown). Shared by the launcher's children and the accelerate-launched
learner ranks.

Each process of a run writes everything it prints to ``run_dir/logs/<process>.log``
(``to_log_file``): its own log records, vLLM's and other libraries', the output of the processes
it starts (vLLM's engine core inherits the file), raw tracebacks. The launcher follows those
files and alone writes to the console (``pipeline.launch.console``). Lines meant for the user
(progress, the summary) are records of the ``CONSOLE`` logger.

A full disk never stops a process through its output: its ``sys.stdout`` and ``sys.stderr``
(``LogStream``) drop a line the log file has no room for, count it (``dropped_lines``), and send
it to the launcher over a socket that needs no disk (``CONSOLE_SOCKET``), which shows it if it
is a line for the console; no print or log record raises, and no "--- Logging error ---" block
is written. Once there is room again, one line in the file says how many were dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import multiprocessing
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pipeline.appendfile import write_all

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


CONSOLE_SOCKET = "PIPELINE_CONSOLE_SOCKET"
"""Environment variable: the launcher's datagram socket (Linux abstract namespace: no file) for
the lines a child's log file has no room for (``LogStream``, ``pipeline.launch.console``)."""
RELAY_MAX_BYTES = 16384  # a longer line (a traceback record) is cut to this when relayed
# A record below WARNING, ours ("12:00:00 producer0 pipeline.x INFO ...") or a library's: the
# console does not show it, so it is not relayed (the socket queues a few datagrams only).
_QUIET_RECORD = re.compile(r"^(?:\S+\s+){0,4}?\[?(DEBUG|INFO)\b")
_dropped = [0]  # lines of this process's output its log file could not take


def dropped_lines() -> int:
    """Lines of this process's output dropped so far because its disk was full."""
    return _dropped[0]


class _Relay:
    """This process's end of ``CONSOLE_SOCKET``: best effort, never blocks."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None

    def send(self, data: bytes) -> None:
        name = os.environ.get(CONSOLE_SOCKET)
        if not name:
            return
        with contextlib.suppress(OSError):
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            self._sock.sendto(data[:RELAY_MAX_BYTES], b"\0" + name.encode())


class LogStream(io.TextIOBase):
    """File descriptor 1 or 2 of a run's process (its log file) as ``sys.stdout`` or
    ``sys.stderr``: whole lines, written unbuffered, each write one ``os.write`` (lines of the
    processes sharing the file interleave whole). A line the disk has no room for is dropped,
    counted and relayed (the module docstring); a line is not begun when the file system
    reports less room than it needs, so a line is rarely torn, and one torn by a race is ended
    before the next."""

    encoding = "utf-8"
    errors = "replace"

    def __init__(self, fd: int, relay: bool = True) -> None:
        """``relay``: send a dropped line to the launcher (``CONSOLE_SOCKET``)."""
        super().__init__()
        self._fd = fd
        self._pending = ""
        self._lock = threading.RLock()
        self._torn = False
        self._dropped_here = 0  # dropped since the last line that went in
        self._relay = _Relay() if relay else None

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    @property
    def buffer(self) -> _BinarySide:
        """For code that writes bytes to ``sys.stdout.buffer``: the same lines, decoded."""
        return _BinarySide(self)

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            if "\n" in self._pending:
                head, _, self._pending = self._pending.rpartition("\n")
                self._emit(head + "\n")
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                text, self._pending = self._pending, ""
                self._emit(text)

    def _emit(self, text: str) -> None:
        data = text.encode("utf-8", "replace")
        if self._dropped_here:
            data = self._notice() + data
        if self._torn:
            data = b"\n" + data
        if not self._room_for(len(data)):
            self._drop(text)
            return
        left, full = write_all(self._fd, data)
        if full is not None:
            self._torn = left < len(data)
            self._drop(text)
            return
        self._torn = False
        self._dropped_here = 0

    def _room_for(self, n: int) -> bool:
        try:
            st = os.fstatvfs(self._fd)
        except OSError:
            return True  # not a file system that says: write and see
        free = st.f_bfree if os.geteuid() == 0 else st.f_bavail  # root may use the reserve
        return free * st.f_frsize >= n or st.f_blocks == 0

    def _drop(self, text: str) -> None:
        lines = max(text.count("\n"), 1)
        self._dropped_here += lines
        _dropped[0] += lines
        first = text.lstrip("\n").split("\n", 1)[0]
        if self._relay is not None and (f" {CONSOLE} " in first
                                        or not _QUIET_RECORD.match(first)):
            self._relay.send(text.encode("utf-8", "replace"))

    def _notice(self) -> bytes:
        """A record (``LOG_FORMAT``) saying how many lines this file lacks."""
        return (f"{time.strftime(LOG_DATEFMT)} {multiprocessing.current_process().name} "
                f"{__name__} INFO {self._dropped_here} line(s) of this process's output "
                f"were dropped here: the disk was full\n").encode()


class _BinarySide:
    def __init__(self, stream: LogStream) -> None:
        self._stream = stream

    def write(self, data: bytes) -> int:
        self._stream.write(bytes(data).decode("utf-8", "replace"))
        return len(data)

    def flush(self) -> None:
        self._stream.flush()


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
    # Whole lines as they come (the launcher follows the file as it grows); a full disk drops
    # them (``LogStream``).
    sys.stdout, sys.stderr = LogStream(1), LogStream(2)


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
