"""`pipeline-train` under Popen for the end-to-end tests that watch a run while it goes (kill a
process mid-run, wait for a line): the ``Launcher``, and the checks its tests share (the run's
metrics rows, processes gone)."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

# Generous waits: on a machine whose two cores other jobs keep busy (another suite beside this
# one), a vLLM CPU engine has taken over three minutes to start. The waits bound hangs; the
# assertions after them are what the tests check.
ENGINE_START_S = 600
REPO = Path(__file__).resolve().parents[3]
# A vLLM log record: "(EngineCore pid=7) INFO 11-25 09:01:02 [core.py:12] ..."
VLLM_RECORD = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR)\s+\d\d-\d\d \d\d:\d\d:\d\d \[")
CONNECTED = re.compile(r"producer (p\d+) \(pid (\d+)[^)]*\) connected at version (\d+)")


class Launcher:
    """`python -m pipeline.launch.cli ...` under Popen; stderr is collected line by line."""

    def __init__(self, tiny_model: Path, run_dir: Path, *extra: str, verbose: bool = True):
        """``verbose``: the processes' INFO lines on stderr, which most tests follow; False:
        the console a user sees."""
        cmd = [sys.executable, "-m", "pipeline.launch.cli", "--model", str(tiny_model),
               "--data", "arithmetic:200", "--reward", "pipeline.tasks.rewards:length_reward",
               "--num-producers", "2", "--batch-groups", "2", "--group-size", "4",
               "--max-tokens", "8", "--run-dir", str(run_dir),
               "--engine.max_model_len", "256", "--engine.cpu_kvcache_space_gib", "1",
               "--tensorboard", "false", "--progress", "false",
               *(["--verbose"] if verbose else []), *extra]
        self.run_dir = run_dir
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self._out: list[str] = []
        self.descendants: set[int] = set()  # every process the launcher started, polled
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()
        self._stdout_pump = threading.Thread(target=lambda: self._out.extend(self.proc.stdout),
                                             daemon=True)
        self._stdout_pump.start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def _watch(self) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            me = psutil.Process(self.proc.pid)
            while self.proc.poll() is None:
                with contextlib.suppress(psutil.Error):
                    self.descendants.update(c.pid for c in me.children(recursive=True))
                time.sleep(0.5)

    def connects(self) -> list[tuple[str, int, int]]:
        with self._cond:
            return [(m[1], int(m[2]), int(m[3])) for ln in self.lines
                    if (m := CONNECTED.search(ln))]

    def wait_for(self, pred, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = pred()
            if got:
                return got
            if self.proc.poll() is not None:
                break
            with self._cond:
                self._cond.wait(0.5)
        got = pred()
        assert got, f"timed out waiting for {what}; stderr tail:\n" + self.tail()
        return got

    def steps_done(self) -> int:
        return len(complete_lines(self.run_dir / "metrics.jsonl"))  # counted, not parsed: polled

    @property
    def stdout(self) -> str:
        """The launcher's stdout (the console's figures), whole once it has exited."""
        if self.proc.poll() is not None:
            self._stdout_pump.join(30)
        return "".join(self._out)

    def tail(self, n: int = 60) -> str:
        with self._cond:
            return "\n".join(self.lines[-n:])

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError("launcher did not finish; stderr tail:\n" + self.tail()
                                 ) from None

    def stop(self) -> None:
        """Only on failure: Ctrl-C the launcher (it stops its children), then kill it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def complete_lines(path: Path) -> list[str]:
    """The complete, non-empty lines of a file another process may be appending to: a last line
    without its newline is still being written (a reader can see part of a write), so it is
    left for the next read."""
    text = path.read_text() if path.exists() else ""
    return [line for line in text.split("\n")[:-1] if line.strip()]


def read_jsonl(path: Path) -> list[dict]:
    """The complete records of a JSONL file another process may be writing."""
    return [json.loads(line) for line in complete_lines(path)]


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of run_dir/metrics.jsonl written so far, one per trained step or evaluation."""
    return read_jsonl(run_dir / "metrics.jsonl")


def leaked_segments(before: set[str]) -> set[str]:
    """Engine segments created since ``before`` that no process holds and no running launcher
    has recorded as its own: a run beside this one (pytest-xdist's other worker) may hold a
    killed engine's segments until it reclaims them, which is not this run's leak."""
    from pipeline.launch.shm import list_segments, recorded_by_live_owners, segments_in_use

    return (list_segments() - before) - segments_in_use() - recorded_by_live_owners()


def assert_gone(pids, what: str = "processes", timeout: float = 15.0) -> None:
    """Every process of ``pids`` has exited within ``timeout`` (those already gone count)."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    _gone, alive = psutil.wait_procs(procs, timeout=timeout)
    assert not alive, f"{what} left behind: {[p.pid for p in alive]}"
