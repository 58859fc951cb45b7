"""Process management: validate config, then run the learner and N producers as processes.

Every child runs in its own process group so that stopping it also stops what it started (vLLM's
engine-core processes). On Ctrl-C/SIGTERM the learner gets SIGINT first (it saves a final
checkpoint), producers get SIGTERM, and whatever is left after a grace period gets SIGKILL; the
launcher returns only when no child process group is left. A child that dies stops the whole run
unless ``max_producer_restarts`` allows restarting a dead producer. The dedicated evaluator
(``eval.producer: dedicated``) is started and restarted like a producer, after them; one dead
beyond the restarts is reported in one line and the run goes on without evaluation.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from buffer.ports import free_port
from pipeline.config import RunConfig
from pipeline.launch.console import LogFollower, log_to_run_dir, resource_tracker_to, tell
from pipeline.launch.placement import learner_gpu_env, producer_gpu_env
from pipeline.launch.preflight import prepare
from pipeline.launch.run_dir import (
    roster_for_launch,
    set_aside_previous_run,
    waiting_groups_line,
)
from pipeline.launch.scale import LAUNCHER_FILE, ScaleWatch, plan, record_launcher
from pipeline.launch.shm import (
    forget_record,
    forget_tracked,
    list_segments,
    reclaim_dead_owners,
    reclaim_orphans,
    record_segments,
)
from pipeline.learner.main import learner_entry
from pipeline.options import ConfigError, to_dict
from pipeline.owner import OWNER_ENV, owner_tag
from pipeline.procs import LOGS_DIR, die_with_parent, log_file, wait_group_gone
from pipeline.producer.main import producer_entry
from pipeline.schedule import display_name, evaluator_index, is_evaluator, process_name

log = logging.getLogger("pipeline")












def _config_names_port(path: str) -> bool:
    """Whether an accelerate config file sets main_process_port itself (then it is kept)."""
    if not path:
        return False
    with contextlib.suppress(OSError, yaml.YAMLError):
        data = yaml.safe_load(Path(path).read_text())
        return isinstance(data, dict) and data.get("main_process_port") is not None
    return False


class LaunchedLearner:
    """The learner as ``accelerate launch ... -m pipeline.learner.main`` (``learner_processes``
    > 1 or an accelerate config), behind the slice of ``mp.Process`` that ``run`` uses: its own
    process group (``_stop`` signals the launcher and every rank), SIGTERM if we die."""

    def __init__(self, cfg: RunConfig, model_path: str, resume: bool):
        t = cfg.train
        self.cmd = [sys.executable, "-m", "accelerate.commands.launch",
                    "--num_processes", str(t.learner_processes), "--num_machines", "1"]
        if t.accelerate_config:
            self.cmd += ["--config_file", t.accelerate_config]
        elif t.learner_processes > 1:
            # torchrun launcher: one process per GPU, or gloo on CPU (PolicyTrainer's
            # Accelerator(cpu=True)); accelerate's --cpu launcher would need mpirun.
            self.cmd += ["--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no"]
        self.args = ["-m", "pipeline.learner.main", str(Path(cfg.run_dir) / "config.yaml"),
                     "--model", model_path] + (["--resume"] if resume else [])
        # torchrun's rendezvous port: accelerate's default (29500) is one per host, so a
        # second multi-rank learner on the machine would fail; a free one per start instead.
        self.own_port = not _config_names_port(t.accelerate_config)
        self.cfg = cfg
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        cmd = self.cmd + (["--main_process_port", str(free_port())] if self.own_port else [])
        cmd += self.args
        log.info("learner: %s", " ".join(cmd))
        path = log_file(self.cfg.run_dir, "learner")  # every rank's output, as learner_entry's
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as out:
            self.proc = subprocess.Popen(cmd, preexec_fn=_popen_setup, stdout=out,
                                         stderr=subprocess.STDOUT,
                                         env=os.environ | learner_gpu_env(self.cfg.learner_gpus))

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def join(self, timeout: float | None = None) -> None:
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)


def _popen_setup() -> None:
    os.setpgrp()
    die_with_parent()


def _make_learner(ctx: Any, cfg: RunConfig, cfg_dict: dict, model_path: str, resume: bool
                  ) -> Any:
    if cfg.train.learner_processes > 1 or cfg.train.accelerate_config:
        return LaunchedLearner(cfg, model_path, resume)
    return ctx.Process(target=learner_entry, name="learner",
                       args=(cfg_dict, model_path, resume, learner_gpu_env(cfg.learner_gpus), True))


def _stop(proc: mp.Process, sig: int, group: bool = True) -> None:
    """Signal ``proc``'s process group (``group``; the process itself if it has none yet), or
    the process alone. Once, never both: a learner that gets SIGINT twice takes the second as
    "stop now" (asyncio) and its final checkpoint is cut short."""
    if proc.pid is None:
        return
    if group:
        try:
            os.killpg(proc.pid, sig)
            return
        except (ProcessLookupError, PermissionError):
            pass  # no group of its own yet: the process alone
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(proc.pid, sig)


def _reap(procs: list[mp.Process], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        _stop(p, signal.SIGKILL)  # the whole group, including vLLM engine cores
        p.join(5)


def run(cfg: RunConfig, *, role: str = "all", resume: bool = False, producer_index: int = 0,
        max_producer_restarts: int = 0, max_learner_restarts: int = 0,
        verbose: bool = False) -> int:
    """Run ``role`` (all | learner | producer) to completion; returns an exit code.

    Each process writes its output to ``run_dir/logs/<process>.log``; the console shows the
    progress lines, the summary, warnings and errors (``verbose``: every line of every process).
    """
    # 1. Everything that can fail is checked before any process starts.
    model_path = prepare(cfg, role)
    cfg, memory_plan = plan_memory(cfg, model_path, role)
    if role in ("all", "learner"):
        check_fresh_run_space(cfg, model_path, resume)
    ray_rewards = _check_ray_rewards(cfg, role)
    # 2. Children inherit this launcher's owner tag: what they leave in /dev/shm names it, so a
    #    later run reclaims it should this launcher be killed (pipeline.launch.shm).
    os.environ[OWNER_ENV] = owner_tag()
    reclaim_dead_owners()
    shm_before = list_segments()  # what a dead engine leaves behind is reclaimed against this
    # 3. The run's directory: an earlier run set aside, the launcher's log, the config.
    run_dir = Path(cfg.run_dir)
    file_log, follower = _set_up_run_dir(cfg, role, resume, verbose)
    if memory_plan is not None:  # beside config.yaml: the bench reads the predicted peak
        (run_dir / "memory_plan.json").write_text(json.dumps(memory_plan, indent=1))
    # 4. The children, started after the signal handlers and the reward replicas.
    sup = _Supervisor(cfg, role, model_path, resume, producer_index, shm_before, follower,
                      max_producer_restarts, max_learner_restarts)
    # SIGTERM (e.g. from `timeout` or a job scheduler) stops the run like Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # Also SIGINT: a launcher started in the background (`cmd &`) inherits SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if role == "producer" and cfg.producer_slots > cfg.num_producers:
        # An elastic run's producer started by hand leaves it cleanly on `kill -USR1`.
        signal.signal(signal.SIGUSR1, lambda *_: sup.ask_to_leave(producer_index))
    reward_cluster = None
    if ray_rewards and role == "all":  # before any child: they inherit where the replicas are
        from pipeline.launch.ray_cluster import RewardCluster

        reward_cluster = RewardCluster(cfg)
    sup.start()
    # 5. Supervise until the run is over, restarting children within their limits.
    code = 0
    try:
        while (done := sup.poll()) is None:
            time.sleep(0.5)
        code = done
    except (KeyboardInterrupt, SystemExit):
        code = sup.code or 130
        log.warning("stopping: learner saves a checkpoint, producers shut down")
        sup.interrupt()
    finally:
        # 6. Every child stopped, shared memory reclaimed, the replicas stopped, the last lines.
        sup.reap()
        if reward_cluster is not None:
            reward_cluster.stop()
        follower.pump(final=True)
        if role == "all":  # every producer is gone: their outboxes are final
            _report_waiting_groups(run_dir, cfg.train.max_staleness)
        logging.getLogger().removeHandler(file_log)
        file_log.close()
    return code


def check_fresh_run_space(cfg: RunConfig, model_path: str, resume: bool) -> None:
    """A fresh run's disk holds its checkpoints besides an earlier run's: that run is set aside
    on the same disk (``set_aside_previous_run``) and keeps its bytes, so its checkpoints are
    not counted as this run's (the check before, ``prepare``, cannot tell a fresh run from a
    resumed one). Raises the one-line ConfigError before anything is moved or started."""
    from pipeline.learner.disk import check_run_space

    short = None if resume else check_run_space(cfg, model_path, own_checkpoints=False)
    if short:
        raise ConfigError(short)


def plan_memory(cfg: RunConfig, model_path: str, role: str
                ) -> tuple[RunConfig, dict[str, Any] | None]:
    """The learner's memory plan (``pipeline.memory_plan``) applied to the run's config before
    config.yaml is written, so every role reads the same options: its line on the console, a
    warning line for each value of the user's that will not fit; the plan's record, or None
    where no plan applies (no GPU, a producer-only launcher, a sharded learner)."""
    if role not in ("all", "learner"):
        return cfg, None
    from pipeline.memory_plan import apply_memory_plan, record

    planned, plan, lines = apply_memory_plan(cfg, model_path)
    if plan is None:
        return cfg, None
    tell(log, lines[0])
    for line in lines[1:]:
        log.warning("%s", line)
    return planned, record(plan)


def _check_ray_rewards(cfg: RunConfig, role: str) -> bool:
    """Whether the run has ``executor: ray`` rewards, which only a whole run can start."""
    ray_rewards = [i for i, s in enumerate(cfg.rewards.specs) if s.executor == "ray"]
    if ray_rewards and role == "producer":
        raise ConfigError(f"rewards.specs[{ray_rewards[0]}].executor: ray rewards run on replicas "
                          "that the whole run's launcher starts; --role producer cannot use them")
    return bool(ray_rewards)


def _set_up_run_dir(cfg: RunConfig, role: str, resume: bool, verbose: bool
                    ) -> tuple[logging.Handler, LogFollower]:
    """run_dir ready for the children: a fresh run sets an earlier one aside and drops its
    outboxes; the launcher's own log and the follower of the children's logs start before any
    child writes; the config is written. Returns the launcher's log handler and the follower."""
    run_dir = Path(cfg.run_dir)
    if not resume and role in ("all", "learner"):
        set_aside_previous_run(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    file_log = log_to_run_dir(run_dir)
    resource_tracker_to(log_file(run_dir, "launcher"))  # before the first child shares it
    # Before any child writes, or starts: they inherit the relay's name.
    follower = LogFollower(run_dir / LOGS_DIR, verbose=verbose, relay=True)
    if not resume:
        # A fresh run must not resend the outbox of an earlier run in the same run_dir.
        for stale in (run_dir / "producers").glob("*.wal"):
            stale.unlink()
    if role in ("all", "learner"):
        roster_for_launch(run_dir, resume, cfg.num_producers)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return file_log, follower


def _report_waiting_groups(run_dir: Path, max_staleness: int) -> None:
    """The end-of-run line about groups left in the producers' outboxes, if any."""
    try:
        line = waiting_groups_line(run_dir, max_staleness)
    except Exception as e:  # a report, never a reason to fail the run's end
        log.warning("could not count the groups left in the producers' outboxes: %r", e)
        line = None
    if line is not None:
        log.info("%s", line)
        print(line, flush=True)


class _Supervisor:
    """The run's children on this machine: started together, watched every half second (a dead
    learner or producer restarted within its limit, else the run ends), and stopped in order
    (learner first, with its final checkpoint; then each producer alone; then whatever is left,
    group and all)."""

    def __init__(self, cfg: RunConfig, role: str, model_path: str, resume: bool,
                 producer_index: int, shm_before: set[str], follower: LogFollower,
                 max_producer_restarts: int, max_learner_restarts: int):
        self.cfg, self.model_path, self.shm_before = cfg, model_path, shm_before
        self.follower = follower
        self.max_producer_restarts = max_producer_restarts
        self.max_learner_restarts = max_learner_restarts
        self.run_dir = Path(cfg.run_dir)
        self.ctx = mp.get_context("spawn")
        self.cfg_dict = to_dict(cfg)
        self.learner: Any = None
        if role in ("all", "learner"):
            self.learner = _make_learner(self.ctx, cfg, self.cfg_dict, model_path, resume)
        # The producers the run starts with, then the dedicated evaluator if any (its index
        # follows every producer index an elastic run may add: RunConfig.producer_slots).
        evaluator = evaluator_index(cfg.producer_slots, cfg.eval.every, cfg.eval.producer)
        indices = [*range(cfg.num_producers), *([] if evaluator is None else [evaluator])] \
            if role == "all" else (
            [producer_index] if role == "producer" else [])
        # --role producer: its producer exits when the learner announces its last step.
        self.producers = {i: self.ctx.Process(target=producer_entry, name=f"producer{i}",
                                              args=(self.cfg_dict, model_path, i,
                                                    self._gpu_env(i), role == "producer", True))
                          for i in indices}
        # Elastic runs (max_producers): `pipeline-train scale` requests, and who is leaving.
        self.scale = ScaleWatch(self.run_dir) \
            if role == "all" and cfg.producer_slots > cfg.num_producers else None
        self.leaving: set[int] = set()
        self.procs = ([self.learner] if self.learner else []) + list(self.producers.values())
        self.code = 0  # the exit code decided while supervising
        self.restarts = 0
        self.learner_restarts = 0
        self.recorded: set[str] | None = None
        self.next_record = 0.0

    def start(self) -> None:
        for p in self.procs:
            p.start()
        names = (["learner"] if self.learner else []) + [process_name(self.cfg_dict, i)
                                                         for i in self.producers]
        print(f"pipeline-train: started {', '.join(names)}; their logs: "
              f"{self.run_dir / LOGS_DIR}/ (--verbose shows them here)", flush=True)
        if self.scale is not None:
            record_launcher(self.run_dir)
            print(f"pipeline-train: elastic, up to {self.cfg.producer_slots} producers: "
                  f"pipeline-train scale {self.run_dir} --producers N", flush=True)

    def poll(self) -> int | None:
        """One look at the children: the run's exit code once it is over, else None. A
        producer that died beyond its restarts ends the run with SystemExit (code 1)."""
        learner = self.learner
        if learner is not None and not learner.is_alive():
            self.code = learner.exitcode or 0
            if self.code and self.learner_restarts < self.max_learner_restarts:
                self._restart_learner()
                return self.poll()
            if self.code:
                log.error("learner exited with code %d; stopping producers", self.code)
            return self.code
        self._scale()
        for i, p in list(self.producers.items()):
            if p.is_alive():
                continue
            if learner is None:  # producer-only role: its exit is the end
                return p.exitcode or 0
            if i in self.leaving:  # asked to leave (pipeline-train scale): never restarted
                self._left(i, p)
            elif self.restarts < self.max_producer_restarts:
                self._restart_producer(i, p)
            elif is_evaluator(self.cfg_dict, i):  # training goes on without evaluation
                log.error("the evaluator died (exit %s); training goes on without evaluation",
                          p.exitcode)
                del self.producers[i]
                self._bury(p)
            else:
                log.error("producer %d died (exit %s); stopping the run", i, p.exitcode)
                self.code = 1
                raise SystemExit(self.code)
        if time.monotonic() >= self.next_record:
            self.recorded = record_segments(self.shm_before, known=self.recorded)
            self.next_record = time.monotonic() + 5.0
        self.follower.pump()
        return None

    def _restart_learner(self) -> None:
        """Producers keep running: they hold every group the learner's last checkpoint lacks
        and resend it to the restored learner."""
        from pipeline.learner.checkpoint import latest_checkpoint

        self.learner_restarts += 1
        has_ckpt = latest_checkpoint(self.run_dir) is not None
        log.warning("learner died (exit %s); restarting it %s(%d/%d)", self.code,
                    "from its last checkpoint " if has_ckpt else "",
                    self.learner_restarts, self.max_learner_restarts)
        _stop(self.learner, signal.SIGKILL)
        self.learner = _make_learner(self.ctx, self.cfg, self.cfg_dict, self.model_path,
                                     has_ckpt)
        self.learner.start()
        self.procs.append(self.learner)
        self.code = 0

    def _restart_producer(self, i: int, p: Any) -> None:
        self.restarts += 1
        log.warning("%s died (exit %s); restarting (%d/%d)", display_name(self.cfg_dict, i),
                    p.exitcode, self.restarts, self.max_producer_restarts)
        self._bury(p)
        self._start_producer(i)

    def _gpu_env(self, i: int) -> dict[str, str]:
        """Engine ``i``'s GPU pin (``pipeline.launch.placement``)."""
        return producer_gpu_env(self.cfg.producer_gpus, i)

    def _start_producer(self, i: int) -> None:
        new = self.ctx.Process(target=producer_entry,
                               args=(self.cfg_dict, self.model_path, i, self._gpu_env(i), False,
                                     True),
                               name=f"producer{i}")
        new.start()
        self.producers[i] = new
        self.procs.append(new)

    def _scale(self) -> None:
        """Apply a new ``pipeline-train scale`` request, if any (``pipeline.launch.scale``)."""
        req = self.scale.poll() if self.scale is not None else None
        if req is None:
            return
        running = [i for i, p in self.producers.items() if p.is_alive()
                   and not is_evaluator(self.cfg_dict, i) and i not in self.leaving]
        todo = plan(req, running, self.cfg.producer_slots, sorted(self.leaving))
        if todo.problem:
            log.error("scale: %s", todo.problem)
        for i in todo.start:
            tell(log, f"scale: starting producer {i}; it joins the run once its engine is up")
            self._start_producer(i)
        for i in todo.leave:
            tell(log, f"scale: producer {i} leaves the run once the groups it started are in "
                 "the learner's checkpoint")
            self.ask_to_leave(i)

    def ask_to_leave(self, i: int) -> None:
        """SIGUSR1 to producer ``i``: it leaves the run cleanly (``Producer._leave``)."""
        self.leaving.add(i)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.producers[i].pid, signal.SIGUSR1)

    def _left(self, i: int, p: Any) -> None:
        """A producer asked to leave has exited: out of the table for good."""
        self.leaving.discard(i)
        del self.producers[i]
        if p.exitcode == 0:
            tell(log, f"producer {i} left the run")
        else:
            log.error("producer %d died while leaving (exit %s); groups of it that no "
                      "checkpoint holds stay in its outbox log (run_dir/producers/)", i,
                      p.exitcode)
        self._bury(p)

    def _bury(self, p: Any) -> None:
        """A dead producer's (or evaluator's) group killed, its shared memory reclaimed."""
        _stop(p, signal.SIGKILL)
        p.join(5)
        wait_group_gone(p.pid)  # its engine core may still hold the segments
        forget_tracked(reclaim_orphans(self.shm_before))

    def interrupt(self) -> None:
        """Ctrl-C / SIGTERM / a fatal death: the learner gets SIGINT and time for its final
        checkpoint."""
        if self.learner is not None and self.learner.is_alive():
            _stop(self.learner, signal.SIGINT)
            self.learner.join(120)

    def reap(self) -> None:
        """Each producer alone: it aborts its requests and shuts its engine down in order (the
        engine core stops its workers). A signal to its group would also reach vLLM's workers,
        which then die under a live engine core ("Worker proc VllmWorker-0 died unexpectedly",
        a fatal-error dump on the console). _reap kills the group of what is left."""
        for p in self.producers.values():
            _stop(p, signal.SIGTERM, group=False)
        _reap(self.procs, grace_s=20.0)
        forget_tracked(reclaim_orphans(self.shm_before))
        forget_record()
        if self.scale is not None:
            (self.run_dir / LAUNCHER_FILE).unlink(missing_ok=True)
