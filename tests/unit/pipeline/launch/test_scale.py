"""`pipeline-train scale` (pure logic and files: no launcher runs here; the e2e test
tests/e2e/test_elastic.py scales a real run)."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from pipeline.launch.scale import (
    LAUNCHER_FILE,
    SCALE_FILE,
    ScaleWatch,
    main,
    plan,
    record_launcher,
)


def test_more_producers_take_the_lowest_free_indices():
    assert plan({"producers": 3}, [0], 4).start == [1, 2]
    assert plan({"producers": 3}, [0, 2], 4).start == [1]
    p = plan({"producers": 2}, [0, 1], 4)  # as many as run: nothing to do
    assert not p.start and not p.leave and not p.problem


def test_fewer_producers_ask_the_highest_indices_to_leave():
    p = plan({"producers": 1}, [2, 0, 3], 4)
    assert p.leave == [2, 3] and not p.start and not p.problem


def test_remove_names_one_running_producer_and_never_the_last():
    assert plan({"remove": "p2"}, [0, 2], 4).leave == [2]
    assert "not one of the running producers (p0, p2)" in plan({"remove": "p1"}, [0, 2], 4).problem
    assert "not one of" in plan({"remove": "x"}, [0, 2], 4).problem
    assert "last producer" in plan({"remove": "p0"}, [0], 4).problem


@pytest.mark.parametrize("n", [0, 5, "2", None])
def test_a_count_out_of_range_is_a_problem_not_an_action(n):
    p = plan({"producers": n}, [0], 4)
    assert "1 .. max_producers (4)" in p.problem and not p.start and not p.leave


def test_each_request_is_seen_once_and_an_old_one_never(tmp_path):
    (tmp_path / SCALE_FILE).write_text(json.dumps({"producers": 2, "id": "old"}))
    watch = ScaleWatch(tmp_path)  # a request left by an earlier launcher is not applied
    assert watch.poll() is None
    (tmp_path / SCALE_FILE).write_text(json.dumps({"producers": 3, "id": "new"}))
    assert watch.poll() == {"producers": 3, "id": "new"}
    assert watch.poll() is None
    (tmp_path / SCALE_FILE).write_text("{not json")
    assert watch.poll() is None


def _run_dir(tmp_path, num: int = 1, most: int = 3):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"num_producers": num,
                                                          "max_producers": most}))
    return tmp_path


def _one_line_error(capsys, argv, text):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own mistakes
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert text in err and len(err.strip().splitlines()) == 1, err


def test_command_errors_are_one_line_exit_2(tmp_path, capsys):
    _one_line_error(capsys, [str(tmp_path / "none"), "--producers", "2"],
                    "is not a run_dir of pipeline-train")
    (tmp_path / "fixed").mkdir()
    fixed = _run_dir(tmp_path / "fixed", 1, 0)
    _one_line_error(capsys, [str(fixed), "--producers", "2"], "was not started elastic")
    run = _run_dir(tmp_path)
    _one_line_error(capsys, [str(run), "--producers", "2"], "no launcher of")
    dead = {"pid": 2**22 + 12345, "owner": str(2**22 + 12345), "host": os.uname().nodename}
    (run / LAUNCHER_FILE).write_text(json.dumps(dead))
    _one_line_error(capsys, [str(run), "--producers", "2"], "no launcher of")  # a dead one
    reused = {"pid": os.getpid(), "owner": f"{os.getpid()}-1", "host": os.uname().nodename}
    (run / LAUNCHER_FILE).write_text(json.dumps(reused))  # its pid now another process's
    _one_line_error(capsys, [str(run), "--producers", "2"], "no launcher of")
    record_launcher(run)  # this test process stands for a live launcher
    _one_line_error(capsys, [str(run), "--producers", "4"], "1 .. max_producers (3)")
    _one_line_error(capsys, [str(run)], "one of the arguments --producers --remove")


def test_a_request_is_written_for_the_launcher(tmp_path, capsys):
    run = _run_dir(tmp_path)
    record_launcher(run)
    watch = ScaleWatch(run)
    assert main([str(run), "--producers", "2"]) == 0
    assert f"launcher (pid {os.getpid()}) for 2 producers" in capsys.readouterr().out
    assert watch.poll()["producers"] == 2
    assert main([str(run), "--remove", "p0"]) == 0
    assert watch.poll()["remove"] == "p0"
    assert not list(run.glob(".scale*"))  # written whole, by rename


def test_an_index_still_leaving_is_not_given_to_a_new_producer():
    """p1 asked to leave and still running: a second p1 would fight the first over its id."""
    p = plan({"producers": 2}, [0], 2, leaving=[1])
    assert p.start == [] and "p1 is still leaving" in p.problem
    assert plan({"producers": 2}, [0], 4, leaving=[1]).start == [2]
    p = plan({"producers": 4}, [0], 4, leaving=[1])  # two fit, the third waits for p1
    assert p.start == [2, 3] and "p1 is still leaving" in p.problem


class _FakeProcess:
    """Stands for a running producer process (the supervisor only asks these)."""

    def __init__(self, exitcode: int | None = None):
        self.exitcode, self.pid = exitcode, 2**22 + 7

    def is_alive(self) -> bool:
        return self.exitcode is None


def test_joins_and_leaves_show_on_the_console_fake_processes(tmp_path, capsys):
    """The local supervisor applies a scale request: the join and the leave are console lines
    (stdout), as `pipeline-train scale` promises, not only launcher.log records."""
    from pipeline.config import load_config
    from pipeline.launch.console import LogFollower
    from pipeline.launch.local import _Supervisor

    cfg = load_config(overrides={"run_dir": str(tmp_path), "num_producers": 1,
                                 "max_producers": 2, "data.path": "arithmetic:10"})
    (tmp_path / "logs").mkdir()
    sup = _Supervisor(cfg, "all", "model", False, 0, set(), LogFollower(tmp_path / "logs"), 0, 0)
    sup.producers = {0: _FakeProcess()}
    started, asked = [], []
    sup._start_producer = lambda i: (started.append(i), sup.producers.update({i: _FakeProcess()}))
    sup.ask_to_leave = lambda i: (asked.append(i), sup.leaving.add(i))
    sup._bury = lambda p: None

    (tmp_path / SCALE_FILE).write_text(json.dumps({"producers": 2, "id": "a"}))
    sup._scale()
    (tmp_path / SCALE_FILE).write_text(json.dumps({"remove": "p1", "id": "b"}))
    sup._scale()
    sup._left(1, _FakeProcess(exitcode=0))
    assert started == [1] and asked == [1]
    assert capsys.readouterr().out.splitlines() == [
        "pipeline-train: scale: starting producer 1; it joins the run once its engine is up",
        "pipeline-train: scale: producer 1 leaves the run once the groups it started are in "
        "the learner's checkpoint",
        "pipeline-train: producer 1 left the run"]
