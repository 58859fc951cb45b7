"""The quiet console: which log lines reach it, the launcher following per-process log files,
and a real child process (and its own child) writing into its log file."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from pipeline.launch.console import LineFilter, LogFollower
from pipeline.procs import log_file

OURS = "09:01:02 producer0 pipeline.producer.loop {level} {msg}"
VLLM = "(EngineCore pid=4242) {level} 11-25 09:01:02 [core.py:12] {msg}"


def feed(lines: list[str], verbose: bool = False) -> list[tuple[str, str] | None]:
    f = LineFilter(verbose)
    return [f.feed(line) for line in lines]


def test_info_lines_stay_in_the_file_our_warnings_and_all_errors_reach_the_console():
    lines = [
        OURS.format(level="INFO", msg="engine ready"),
        VLLM.format(level="INFO", msg="setting pause state to PAUSED_ALL"),
        "(producer0 pid=7) INFO 11-25 09:01:02 [loader.py:1] Loading weights took 0.1 s",
        "INFO 11-25 09:01:02 [api.py:3] vLLM 0.25.1 style line",
        OURS.format(level="WARNING", msg="prompt 7: reward flaky raised"),
        VLLM.format(level="ERROR", msg="engine core died"),
        OURS.format(level="ERROR", msg="p0: load failed"),
    ]
    assert feed(lines) == [None] * 4 + [("err", x) for x in lines[4:]]


def test_library_warnings_stay_in_the_file_and_are_counted():
    f = LineFilter()
    lines = [
        VLLM.format(level="WARNING", msg="Triton is not installed."),
        "09:16:04 producer0 vllm.triton_utils.importing WARNING Triton is installed, but",
        "/site-packages/vllm/x.py:138: FutureWarning: `reduce_op` is deprecated",
        "  if hasattr(value, '__dict__'):",
        "09:16:04 producer0 py.warnings WARNING /site-packages/torch/x.py:1: UserWarning: x",
        "09:16:04 learner py.warnings WARNING /repo/pipeline/x.py:1: UserWarning: ours",
        "/repo/pipeline/learner/x.py:3: UserWarning: also ours",
    ]
    assert [f.feed(x) for x in lines] == [None] * 5 + [("err", lines[5]), ("err", lines[6])]
    assert f.hidden_warnings == 4


def test_a_bracketed_library_warning_after_a_console_line_is_not_its_continuation():
    f = LineFilter()
    ds = ("[2026-11-26 14:11:23,787] [WARNING] [real_accelerator.py:213:get_accelerator] "
          "Setting accelerator to CPU.")
    step = "09:01:02 learner pipeline.console INFO step 40/40 | reward 1.00"
    assert [f.feed(x) for x in (step, ds)] == [("out", "step 40/40 | reward 1.00"), None]
    assert f.hidden_warnings == 1


def test_verbose_shows_every_line():
    lines = [OURS.format(level="INFO", msg="a"), VLLM.format(level="INFO", msg="b"), "raw"]
    assert feed(lines, verbose=True) == [("err", x) for x in lines]


def test_console_records_show_their_message_alone_on_stdout():
    lines = [
        "09:05:00 learner pipeline.console INFO step 3/40 | reward 0.41 | 1.8k tok/s",
        "09:06:00 learner pipeline.console INFO reward: first 1 steps 0.1 -> last 1 0.9",
    ]
    assert feed(lines) == [
        ("out", "step 3/40 | reward 0.41 | 1.8k tok/s"),
        ("out", "reward: first 1 steps 0.1 -> last 1 0.9"),
    ]


def test_continuation_lines_follow_their_record():
    lines = [
        OURS.format(level="ERROR", msg="group failed"),
        "Traceback (most recent call last):",
        '  File "loop.py", line 3, in run',
        "ValueError: bad",
        OURS.format(level="INFO", msg="retrying"),
        "  an INFO record's second line",
        "Loading safetensors checkpoint shards: 100% 1/1",
    ]
    assert feed(lines) == [("err", x) for x in lines[:4]] + [None, None, None]


def test_raw_tracebacks_and_python_warnings_reach_the_console():
    lines = [
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "RuntimeError: engine core died",
        "/repo/pipeline/x.py:12: UserWarning: no tokens in this batch",
        "  warnings.warn(msg)",
        "Fatal Python error: Segmentation fault",
    ]
    assert feed(lines) == [("err", x) for x in lines]


def test_follower_copies_new_lines_of_every_process_and_skips_the_launchers_own(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "learner.log").write_text(OURS.format(level="WARNING", msg="from before") + "\n")
    out, err = io.StringIO(), io.StringIO()
    follower = LogFollower(logs, out=out, err=err)
    with (logs / "learner.log").open("a") as f:
        f.write("09:05:00 learner pipeline.console INFO step 1/2 | reward 0.1\n")
        f.write(OURS.format(level="WARNING", msg="half a li"))  # no newline yet
    (logs / "producer-0.log").write_text(
        VLLM.format(level="INFO", msg="quiet")
        + "\n"
        + VLLM.format(level="WARNING", msg="noted")
        + "\n"
        + VLLM.format(level="ERROR", msg="loud")
        + "\n"
    )
    (logs / "launcher.log").write_text(OURS.format(level="ERROR", msg="shown already") + "\n")
    follower.pump()
    assert out.getvalue() == "step 1/2 | reward 0.1\n"
    assert err.getvalue() == VLLM.format(level="ERROR", msg="loud") + "\n"
    with (logs / "learner.log").open("a") as f:
        f.write("ne\n")
    follower.pump()
    assert err.getvalue().endswith(OURS.format(level="WARNING", msg="half a line") + "\n")
    with (logs / "learner.log").open("a") as f:
        f.write(OURS.format(level="ERROR", msg="last words"))  # a process killed mid-line
    follower.pump(final=True)
    assert err.getvalue().endswith(
        "last words\npipeline-train: 1 warnings of vLLM and other libraries are in "
        f"{logs}/ (--verbose shows them)\n"
    )
    assert "from before" not in err.getvalue() and "shown already" not in err.getvalue()


def test_library_errors_of_an_engine_shutdown_stay_in_the_file_with_one_line_at_the_end(
    tmp_path,
):
    from pipeline.procs import ENGINE_SHUTDOWN, ENGINE_START

    logs = tmp_path / "logs"
    logs.mkdir()
    out, err = io.StringIO(), io.StringIO()
    follower = LogFollower(logs, out=out, err=err)
    before = VLLM.format(level="ERROR", msg="an error while training")
    ours = OURS.format(level="ERROR", msg="p0: a failure of ours")
    restarted = VLLM.format(level="ERROR", msg="an error of the restarted engine")
    (logs / "producer-0.log").write_text("\n".join([
        before,
        OURS.format(level="INFO", msg=f"p0: {ENGINE_SHUTDOWN}"),
        "(Worker pid=7) ERROR 11-25 09:01:02 [multiproc_executor.py:1] Worker proc died",
        VLLM.format(level="ERROR", msg="EngineCore encountered a fatal error."),
        "Traceback (most recent call last):",
        '  File "core.py", line 1, in run_busy_loop',
        "RuntimeError: cancelled",
        "SchedulerOutput(scheduled_new_reqs=[...])",
        ours,
        OURS.format(level="INFO", msg=f"{ENGINE_START} 0.32.0 AsyncLLM: {{}}"),
        restarted,
    ]) + "\n")
    follower.pump(final=True)
    # Errors before the shutdown, ours, and a restarted engine's show; the shutdown's do not.
    assert err.getvalue().splitlines() == [
        before, ours, restarted,
        f"pipeline-train: 3 library errors as the engines shut down are in "
        f"{logs / 'producer-0.log'}",
    ]
    assert out.getvalue() == ""


def test_a_follower_limited_to_one_file_shows_only_that_process(tmp_path):
    """A Ray actor follows only its own role's file in a log directory other roles share."""
    logs = tmp_path / "logs"
    logs.mkdir()
    out, err = io.StringIO(), io.StringIO()
    follower = LogFollower(logs, out=out, err=err, only=("producer-1.log",))
    for name in ("learner.log", "producer-0.log", "producer-1.log"):
        (logs / name).write_text(OURS.format(level="ERROR", msg=f"from {name}") + "\n")
    follower.pump()
    assert err.getvalue() == OURS.format(level="ERROR", msg="from producer-1.log") + "\n"
    assert out.getvalue() == ""


def test_a_process_and_the_process_it_starts_write_into_its_log_file(tmp_path):
    """Real processes: what the child prints, logs and leaves as a traceback, and what its own
    child (as vLLM's engine core) prints, all land in the child's file, none on its console."""
    path = log_file(tmp_path, "producer-0")
    code = textwrap.dedent(f"""
        import logging, subprocess, sys
        from pathlib import Path
        from pipeline.procs import setup_logging, to_log_file
        to_log_file(Path({str(path)!r}))
        setup_logging()
        print("plain print")
        logging.getLogger("vllm.engine").info("engine INFO record")
        subprocess.run([sys.executable, "-c", "import sys; print('grandchild out'); "
                        "print('grandchild err', file=sys.stderr)"], check=True)
        raise SystemExit("dying words")
    """)
    repo = Path(__file__).resolve().parents[4]
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=repo,
        env={"PYTHONPATH": str(repo)},
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stdout == "" and proc.stderr == ""  # nothing on the console
    text = path.read_text()
    for expected in (
        "plain print",
        "vllm.engine INFO engine INFO record",
        "grandchild out",
        "grandchild err",
        "dying words",
    ):
        assert expected in text, text


_LEAKY = """
import multiprocessing as mp, os, sys
from multiprocessing import shared_memory
from pathlib import Path
from pipeline.launch.console import resource_tracker_to

def child(conn):
    sem = mp.get_context("spawn").Semaphore()  # registered with the parent's tracker
    seg = shared_memory.SharedMemory(create=True, size=64)
    conn.send(seg.name)
    os._exit(0)  # dies like a killed producer: nothing unlinked, nothing unregistered

if __name__ == "__main__":
    if sys.argv[2] == "log":
        resource_tracker_to(Path(sys.argv[1]))
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=child, args=(there,))
    p.start()
    name = here.recv()
    p.join()
    os.unlink(f"/dev/shm/{name}")  # someone else removed it: the tracker's unlink fails
    print("done", flush=True)
"""


def test_the_resource_trackers_exit_warnings_go_to_the_log_not_the_console(tmp_path):
    """Real spawn child that leaks a semaphore and a shared-memory segment: the tracker's
    "leaked ..." and "No such file" warnings, printed after the launcher exits, land in the
    launcher's log file; without it they reach the console (what users saw)."""
    script = tmp_path / "leaky.py"
    script.write_text(_LEAKY)
    root = Path(__file__).resolve().parents[4]
    launcher_log = tmp_path / "logs" / "launcher.log"
    for where in ("console", "log"):
        out = subprocess.run([sys.executable, str(script), str(launcher_log), where],
                             capture_output=True, text=True, timeout=120, cwd=root,
                             env={**os.environ, "PYTHONPATH": str(root)})
        assert out.returncode == 0 and out.stdout == "done\n", out.stderr
        if where == "console":
            assert "leaked semaphore" in out.stderr, out.stderr
            continue
        assert out.stderr == ""
        deadline = time.monotonic() + 30  # the tracker writes once its launcher is gone
        while "No such file" not in launcher_log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        text = launcher_log.read_text()
        assert "leaked semaphore" in text and "leaked shared_memory" in text, text
        assert "No such file or directory" in text, text


def _noisy_block(path: Path, verbose: bool) -> None:
    """What `pipeline-train eval` runs under console_to_log: vLLM's INFO lines and a library
    warning from this process and from a child it starts, and one error."""
    from pipeline.launch.console import console_to_log

    with console_to_log(path, verbose, every_s=0.01):
        os.write(1, (VLLM.format(level="INFO", msg="engine config dump") + "\n").encode())
        subprocess.run([sys.executable, "-c", "import sys; print(sys.argv[1], file=sys.stderr)",
                        VLLM.format(level="WARNING", msg="OpenMP binding")], check=True)
        os.write(2, (VLLM.format(level="ERROR", msg="engine core died") + "\n").encode())
    print("eval: reward_mean 0.5")


def test_console_to_log_keeps_the_engines_lines_in_the_file_and_shows_errors(tmp_path, capfd):
    path = tmp_path / "logs" / "eval.log"
    _noisy_block(path, verbose=False)
    out, err = capfd.readouterr()
    assert out == "eval: reward_mean 0.5\n"
    assert err.splitlines() == [
        VLLM.format(level="ERROR", msg="engine core died"),
        f"pipeline-train: 1 warnings of vLLM and other libraries are in {path.parent}/ "
        "(--verbose shows them)"]
    logged = path.read_text()
    assert "engine config dump" in logged and "OpenMP binding" in logged  # the child's too


def test_console_to_log_verbose_shows_every_line(tmp_path, capfd):
    _noisy_block(tmp_path / "eval.log", verbose=True)
    out, err = capfd.readouterr()
    assert out == "eval: reward_mean 0.5\n"
    assert [x.split("] ", 1)[1] for x in err.splitlines()] == [
        "engine config dump", "OpenMP binding", "engine core died"]


def test_a_full_disk_drops_and_counts_a_childs_lines_and_relays_them_to_the_console(tmp_path):
    """A real child whose log file is on a full 1 MB filesystem (a tmpfs; needs root): its
    prints and records never raise, nothing reaches its own stdout/stderr (no "--- Logging
    error ---" block), every line is counted as dropped and relayed to the launcher, whose
    console shows the warning alone; once there is room the file says how many it lacks."""
    from pipeline.procs import CONSOLE_SOCKET
    from tests.small_fs import small_filesystem

    out, err = io.StringIO(), io.StringIO()
    with small_filesystem(tmp_path / "fs", 1) as fs:
        (fs / "logs").mkdir()
        follower = LogFollower(fs / "logs", out=out, err=err, relay=True)
        assert follower.relay is not None
        path = log_file(fs, "producer-0")
        code = textwrap.dedent(f"""
            import logging
            from pathlib import Path
            from pipeline.procs import dropped_lines, setup_logging, to_log_file
            from tests.small_fs import fill
            to_log_file(Path({str(path)!r}))
            setup_logging()
            loop = logging.getLogger("pipeline.producer.loop")
            loop.info("before the disk fills")
            fill(Path({str(fs / "filler")!r}))
            for i in range(50):
                loop.info("info %d while full", i)
            logging.getLogger("pipeline.producer.outbox").warning("p0: the disk is full")
            print("a print while full")
            assert dropped_lines() == 52, dropped_lines()
            Path({str(fs / "filler")!r}).unlink()
            loop.info("room again")
        """)
        repo = Path(__file__).resolve().parents[4]
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              cwd=repo, timeout=60,
                              env={"PYTHONPATH": str(repo), CONSOLE_SOCKET: follower.relay.name})
        follower.pump(final=True)
        text = path.read_text()
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc.stderr
    assert "before the disk fills" in text and "room again" in text, text
    assert "while full" not in text and "Logging error" not in text, text
    # stderr's count (the print was stdout's: its count comes with its next line)
    assert "INFO 51 line(s) of this process's output were dropped here" in text, text
    shown = err.getvalue().splitlines()
    assert len(shown) == 1 and shown[0].endswith("WARNING p0: the disk is full"), shown
    assert out.getvalue() == ""
