"""Elastic producers: ``pipeline-train scale RUN_DIR --producers N`` (or ``--remove pK``) asks
the launcher of a running job to add or take back producers.

The command writes its request to ``RUN_DIR/scale.json``; the launcher (``pipeline.launch.local``,
which records itself in ``RUN_DIR/launcher.json``) looks at it every half second and applies it:
a new producer takes the lowest free index below ``max_producers`` and joins with its Hello; one
that leaves gets SIGUSR1 and leaves cleanly (``pipeline.producer.loop``, ``Producer._leave``):
nothing it started is lost. The learner's members follow (``pipeline.learner.producers``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.launch.args import OneLineParser
from pipeline.owner import owner_alive, owner_tag

SCALE_FILE = "scale.json"
LAUNCHER_FILE = "launcher.json"


@dataclass
class ScalePlan:
    """What the launcher does for one request: producer indices to start and to ask to leave,
    or why it cannot (``problem``: one line for the console)."""

    start: list[int] = field(default_factory=list)
    leave: list[int] = field(default_factory=list)
    problem: str = ""


def plan(request: dict[str, Any], running: list[int], slots: int,
         leaving: list[int] | tuple[int, ...] = ()) -> ScalePlan:
    """The plan for ``request`` ({"producers": N} or {"remove": "pK"}), given the training
    producers running now (not those already leaving), those still ``leaving`` (asked to, not
    yet exited) and the run's ``slots`` (``max_producers``). New producers take the lowest
    free indices; an index still leaving is not free: a second process with its id would
    refuse the first's incarnation and be refused in turn, for good. ``producers`` below the
    count now asks the highest indices to leave. At least one producer always stays."""
    running = sorted(running)
    if "remove" in request:
        pid = str(request["remove"])
        index = int(pid[1:]) if pid[:1] == "p" and pid[1:].isdigit() else -1
        if index not in running:
            return ScalePlan(problem=f"{pid} is not one of the running producers "
                                     f"({', '.join(f'p{i}' for i in running) or 'none'})")
        if len(running) == 1:
            return ScalePlan(problem=f"{pid} is the last producer; a run keeps at least one")
        return ScalePlan(leave=[index])
    n = request.get("producers")
    if type(n) is not int or not 1 <= n <= slots:
        return ScalePlan(problem=f"--producers must be 1 .. max_producers ({slots}), got {n!r}")
    if n > len(running):
        free = [i for i in range(slots) if i not in running and i not in leaving]
        start = free[:n - len(running)]
        if len(start) == n - len(running):
            return ScalePlan(start=start)
        busy = ", ".join(f"p{i}" for i in sorted(leaving))
        return ScalePlan(start=start, problem=f"{busy} is still leaving; {len(start)} "
                                              f"producer(s) started, ask again once it has left")
    return ScalePlan(leave=running[n:] if n < len(running) else [])


class ScaleWatch:
    """The launcher's side: each new request in ``RUN_DIR/scale.json``, once (by its id)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / SCALE_FILE
        self.seen = _read(self.path).get("id")  # a request left from an earlier launcher

    def poll(self) -> dict[str, Any] | None:
        req = _read(self.path)
        if not req or req.get("id") == self.seen:
            return None
        self.seen = req.get("id")
        return req


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record_launcher(run_dir: Path) -> Path:
    """Say which process launches this run (``pipeline-train scale`` writes to it): its owner
    tag (pid and start time, ``pipeline.owner``), so a reused pid is not taken for it."""
    path = Path(run_dir) / LAUNCHER_FILE
    path.write_text(json.dumps({"pid": os.getpid(), "owner": owner_tag(),
                                "host": os.uname().nodename}))
    return path


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="pipeline-train scale",
                      description="Add or take back producers of a running elastic job (one "
                                  "started with --max_producers above --num-producers).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the running job's run_dir")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--producers", type=int, metavar="N",
                      help="producers to run from now (1 .. max_producers); the highest "
                           "indices leave first")
    what.add_argument("--remove", metavar="ID",
                      help="the producer to take back, e.g. p0 (it leaves cleanly)")
    return p


def main(argv: list[str]) -> int:
    """Check the request against the run, then hand it to its launcher; exit 2 with one line
    when the run is not elastic, has no launcher running, or the request does not fit."""
    import yaml

    args = build_parser().parse_args(argv)
    run_dir = Path(args.run_dir)

    def fail(msg: str) -> int:
        print(f"pipeline-train scale: {msg}", file=sys.stderr)
        return 2

    try:
        conf = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        return fail(f"{run_dir} is not a run_dir of pipeline-train (config.yaml: "
                    f"{type(e).__name__})")
    slots = int(conf.get("max_producers") or 0)
    if slots <= int(conf.get("num_producers", 1)):
        return fail(f"{run_dir} was not started elastic: start it with --max_producers above "
                    f"--num-producers")
    launcher = _read(run_dir / LAUNCHER_FILE)
    pid, owner = launcher.get("pid"), launcher.get("owner")
    if type(pid) is not int or type(owner) is not str or \
            launcher.get("host") != os.uname().nodename or not owner_alive(owner):
        return fail(f"no launcher of {run_dir} runs on this machine ({LAUNCHER_FILE})")
    if args.producers is not None:
        if not 1 <= args.producers <= slots:
            return fail(f"--producers must be 1 .. max_producers ({slots}), got "
                        f"{args.producers}")
        request: dict[str, Any] = {"producers": args.producers}
    else:
        request = {"remove": args.remove}
    request["id"] = f"{os.getpid()}-{time.time_ns()}"
    tmp = run_dir / f".{SCALE_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(request))
    os.replace(tmp, run_dir / SCALE_FILE)
    what = f"{args.producers} producers" if args.producers is not None else \
        f"{args.remove} to leave"
    print(f"asked the launcher (pid {pid}) for {what}; its console says what it does")
    return 0
