"""The launcher's console: what a run shows, and its own log file.

Every process of a run writes all its output to ``run_dir/logs/<process>.log``
(``pipeline.procs.to_log_file``). The launcher follows those files (``LogFollower``) and is
the only process that writes to the console, so lines of different processes never mix:

- records of the ``pipeline.console`` logger (progress lines, the summary): their message
  alone, on stdout;
- errors of any process and library (vLLM's engine core included), raw tracebacks, and the
  warnings of this project's code, each with its continuation lines: on stderr;
- warnings of vLLM and other libraries are counted, and named in one line at the end; so are
  library errors and tracebacks that follow a producer's ``ENGINE_SHUTDOWN`` record in its file
  (up to its next ``ENGINE_START``: the noise of an engine stopping, the run's outcome decided);
- with ``verbose``, every line (the libraries' INFO and warnings too): on stderr.

A line a child's log file has no room for (its disk is full) comes to the launcher over a
datagram socket instead (``ConsoleRelay``; ``pipeline.procs.LogStream`` sends it), and is shown
or not as if read from the file.

The launcher's own records go to ``logs/launcher.log`` (a full disk drops and counts them, as a
child's) and, from WARNING up (every level with ``verbose``), to stderr. Multiprocessing's
resource tracker, which the launcher starts with its stderr in ``launcher.log``, writes there
too: its exit-time warnings about what killed children left ("leaked semaphore objects") stay
in that file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from pipeline.procs import (
    CONSOLE,
    CONSOLE_SOCKET,
    ENGINE_SHUTDOWN,
    ENGINE_START,
    LOG_DATEFMT,
    LOG_FORMAT,
    LOGS_DIR,
    LogStream,
    log_file,
    setup_logging,
    to_log_file,
)

_LEVELS = {
    "DEBUG": 10,
    "INFO": 20,
    "WARN": 30,
    "WARNING": 30,
    "ERROR": 40,
    "CRITICAL": 50,
    "FATAL": 50,
}
_LEVEL = "(DEBUG|INFO|WARN|WARNING|ERROR|CRITICAL|FATAL)"
# Our records: "12:00:00 producer0 pipeline.producer.loop WARNING ..." (pipeline.procs.LOG_FORMAT).
_OUR_RECORD = re.compile(r"^\d\d:\d\d:\d\d \S+ (\S+) " + _LEVEL + r" (.*)$")
# Any other record: its level among the first five words, as vLLM's
# "(EngineCore pid=7) WARNING 11-25 12:00:00 [file.py:12] ..." or "INFO 11-25 ...", or in
# brackets, as DeepSpeed's "[2026-11-25 12:00:00,000] [WARNING] [file.py:12:fn] ...".
_RECORD = re.compile(r"^(?:\S+\s+){0,4}?\[?" + _LEVEL + r"\b")
_PY_WARNING = re.compile(r"^\S+:\d+: \w*Warning: ")  # warnings.warn printed without logging
_ERROR_START = re.compile(r"^(Traceback \(most recent call last\):|Fatal Python error)")
_OWN_LOGGERS = frozenset({"pipeline", "buffer", "sync", "bench", "examples", "__main__"})


class LineFilter:
    """Decides, line by line, what of one log file reaches the console (pure; one per file,
    since a record's continuation lines go where the record they follow goes).

    Shown: console records (their message), errors from anyone, raw tracebacks, and warnings
    of this project's code. Warnings of vLLM and other libraries (platform notes such as
    "Triton is not installed", repeated by every engine process) stay in the file and are
    counted in ``hidden_warnings``; ``verbose`` shows every line."""

    def __init__(self, verbose: bool = False) -> None:
        self.verbose = verbose
        self.hidden_warnings = 0
        self.shutdown_errors = 0  # error records and tracebacks after ENGINE_SHUTDOWN, hidden
        self._shutting_down = False
        self._show = False  # whether the record the next continuation line belongs to shows
        self._console = False  # whether that record is a console line

    def feed(self, line: str) -> tuple[str, str] | None:
        """``("out", text)``, ``("err", text)`` or None (the line stays in the file)."""
        if m := _OUR_RECORD.match(line):
            logger, level, message = m.group(1), _LEVELS[m.group(2)], m.group(3)
            if logger == CONSOLE:
                self._show, self._console = True, True
                return "out", message
            ours = logger.split(".")[0] in _OWN_LOGGERS or (
                logger == "py.warnings" and "site-packages" not in message
            )
            if ours and ENGINE_SHUTDOWN in message:
                self._shutting_down = True
            elif ours and message.startswith(ENGINE_START):  # a restarted producer's engine
                self._shutting_down = False
            self._start(level, ours)
        elif _ERROR_START.match(line):
            self._start(logging.ERROR, not self._shutting_down)
        elif _PY_WARNING.match(line):
            self._start(logging.WARNING, "site-packages" not in line.split(":", 1)[0])
        elif m := _RECORD.match(line):
            self._start(_LEVELS[m.group(1)], False)
        elif self._console:
            return "out", line  # a console message's further lines
        if self.verbose or self._show:
            return "err", line
        return None

    def new_write(self) -> None:
        """The next line begins a write of its own (a relayed datagram): it continues no
        record."""
        self._show = self._console = False

    def _start(self, level: int, ours: bool) -> None:
        self._console = False
        self._show = level >= logging.ERROR or (level >= logging.WARNING and ours)
        if level == logging.WARNING and not ours:
            self.hidden_warnings += 1
        if level >= logging.ERROR and not ours and self._shutting_down:
            self._show = False
            self.shutdown_errors += 1


class ConsoleRelay:
    """The launcher's end of ``CONSOLE_SOCKET``: a datagram socket in Linux's abstract
    namespace (no file, so a full disk cannot stop it), named in the environment the children
    inherit. Each datagram is one write of a child's output that its log file could not take
    (whole lines). Elsewhere (no abstract namespace) there is none, and such lines are only
    counted by the child."""

    def __init__(self) -> None:
        self.name = f"pipeline-console-{os.getpid()}-{os.urandom(4).hex()}"
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(b"\0" + self.name.encode())
        except OSError:
            self._sock.close()
            self._sock = None
            return
        self._sock.setblocking(False)
        os.environ[CONSOLE_SOCKET] = self.name

    def drain(self) -> list[bytes]:
        """The datagrams received since the last call."""
        out = []
        while self._sock is not None:
            try:
                out.append(self._sock.recv(1 << 16))
            except (BlockingIOError, InterruptedError):
                break
        return out

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            if os.environ.get(CONSOLE_SOCKET) == self.name:
                del os.environ[CONSOLE_SOCKET]


class LogFollower:
    """Follows every ``*.log`` file under ``logs_dir`` but the launcher's own (or those named
    in ``only``) and copies to the console what ``LineFilter`` lets through. Files that exist
    when it starts are followed from their end (a resumed run does not replay its earlier
    logs); new ones from the start. ``relay``: also the lines the children's log files could
    not take (``ConsoleRelay``; create the follower before the children start)."""

    def __init__(
        self,
        logs_dir: Path,
        verbose: bool = False,
        out: TextIO | None = None,
        err: TextIO | None = None,
        skip: tuple[str, ...] = ("launcher.log",),
        only: tuple[str, ...] | None = None,
        relay: bool = False,
    ) -> None:
        self.dir, self.verbose, self.skip, self.only = Path(logs_dir), verbose, skip, only
        self._out, self._err = out, err
        self._offsets = {p.name: p.stat().st_size for p in self._files()}
        self._partial: dict[str, bytes] = {}
        self._filters: dict[str, LineFilter] = {}
        self.relay = ConsoleRelay() if relay else None
        self._relayed = LineFilter(verbose)  # lines of every child: each datagram whole lines

    def _files(self) -> list[Path]:
        return sorted(p for p in self.dir.glob("*.log") if p.name not in self.skip
                      and (self.only is None or p.name in self.only))

    def pump(self, final: bool = False) -> None:
        """Copy what the files gained since the last call; ``final``: also a last line that
        has no newline yet (the run is over)."""
        out = self._out if self._out is not None else sys.stdout
        err = self._err if self._err is not None else sys.stderr
        for path in self._files():
            name = path.name
            with path.open("rb") as f:
                f.seek(self._offsets.get(name, 0))
                data = f.read()
            self._offsets[name] = self._offsets.get(name, 0) + len(data)
            lines = (self._partial.pop(name, b"") + data).split(b"\n")
            if not final:
                self._partial[name] = lines.pop()  # an unfinished line waits for its end
            filt = self._filters.setdefault(name, LineFilter(self.verbose))
            for raw in lines:
                if not raw and final:
                    continue
                got = filt.feed(raw.decode("utf-8", errors="replace").rstrip("\r"))
                if got is not None:
                    stream, text = got
                    print(text, file=out if stream == "out" else err)
        for data in self.relay.drain() if self.relay is not None else []:
            self._relayed.new_write()
            for line in data.decode("utf-8", errors="replace").splitlines():
                if got := self._relayed.feed(line.rstrip("\r")):
                    print(got[1], file=out if got[0] == "out" else err)
        if final and self.relay is not None:
            self.relay.close()
        if final and not self.verbose and self.hidden_warnings:
            print(
                f"pipeline-train: {self.hidden_warnings} warnings of vLLM and other libraries "
                f"are in {self.dir}/ (--verbose shows them)",
                file=err,
            )
        shutdown = sorted(n for n, f in self._filters.items() if f.shutdown_errors)
        if final and not self.verbose and shutdown:
            count = sum(self._filters[n].shutdown_errors for n in shutdown)
            print(f"pipeline-train: {count} library errors as the engines shut down are in "
                  f"{', '.join(str(self.dir / n) for n in shutdown)}", file=err)
        out.flush()
        err.flush()

    @property
    def hidden_warnings(self) -> int:
        return sum(f.hidden_warnings for f in self._filters.values()) + \
            self._relayed.hidden_warnings


@contextlib.contextmanager
def console_to_log(path: Path, verbose: bool = False, every_s: float = 0.2) -> Iterator[None]:
    """Run a block with this process's output in ``path``, and the console showing what a run's
    console shows (``LineFilter``): for a command that starts an engine in its own process
    (``pipeline-train eval``), whose INFO lines and library warnings would flood the console.

    File descriptors 1 and 2 point at ``path`` for the block, so the engine processes started in
    it write there too; a thread copies the filtered lines to the console meanwhile. After the
    block the console is back, with the count of hidden warnings."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = os.dup(1), os.dup(2)
    out, err = os.fdopen(os.dup(saved[0]), "w"), os.fdopen(os.dup(saved[1]), "w")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    follower = LogFollower(path.parent, verbose, out=out, err=err, only=(path.name,))
    stop = threading.Event()

    def follow() -> None:
        while not stop.wait(every_s):
            follower.pump()

    to_log_file(path)
    thread = threading.Thread(target=follow, name="console-follower", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        follower.pump(final=True)
        out.close()
        err.close()


def tell(logger: logging.Logger, message: str) -> None:
    """A launcher event the user watches for (a producer joins or leaves an elastic run): on
    the console's stdout, as a restart's line is on stderr, and in ``launcher.log``."""
    logger.info("%s", message)
    print(f"pipeline-train: {message}", flush=True)


def launcher_logging(verbose: bool) -> None:
    """The launcher's records: stderr from WARNING up (all with ``verbose``); once the run
    directory is known, ``log_to_run_dir`` adds its file."""
    setup_logging()
    for handler in logging.getLogger().handlers:
        handler.setLevel(logging.INFO if verbose else logging.WARNING)


def resource_tracker_to(path: Path) -> None:
    """Start multiprocessing's resource tracker with its stderr appended to ``path`` (the
    launcher's log file), before the first child is spawned.

    Every spawned child (producers, learner, their vLLM engine cores) shares the launcher's
    tracker, which starts on the first spawn and inherits the launcher's stderr, the console.
    When the launcher exits, the tracker cleans up what killed children registered and warns
    about each ("There appear to be N leaked semaphore objects", "leaked shared_memory objects",
    "No such file or directory" for a segment someone else already unlinked) after the log
    follower has stopped: those library lines belong in the log, like other library warnings.
    A tracker already running (the launcher embedded in another program) is left as it is."""
    from multiprocessing import resource_tracker

    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    console = os.dup(2)
    try:
        with path.open("ab") as f:
            os.dup2(f.fileno(), 2)  # what the tracker process inherits as its stderr
            resource_tracker.ensure_running()
    finally:
        os.dup2(console, 2)
        os.close(console)


class _LogFileHandler(logging.StreamHandler):
    """Records appended to a log file through a ``LogStream``: a full disk drops and counts
    them (``pipeline.procs.dropped_lines``); never a "--- Logging error ---" block on the
    console. Its lines are not relayed: the launcher's console has its records already."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        super().__init__(LogStream(self._fd, relay=False))

    def close(self) -> None:
        super().close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def log_to_run_dir(run_dir: Path) -> logging.Handler:
    """Add ``run_dir/logs/launcher.log`` to the launcher's records (every level from INFO)."""
    path = log_file(run_dir, "launcher")
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = _LogFileHandler(path)
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATEFMT))
    logging.getLogger().addHandler(handler)
    return handler


__all__ = ["LOGS_DIR", "ConsoleRelay", "LineFilter", "LogFollower", "console_to_log",
           "launcher_logging", "log_to_run_dir", "resource_tracker_to", "tell"]
