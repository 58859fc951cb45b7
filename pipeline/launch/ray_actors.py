"""The Ray launcher's actors: ``LearnerActor`` and ``ProducerActor``, each running its role (the
same entry points as the local launcher) as a child process on the node Ray placed it on.

Each actor runs its child in the child's own process group, so stopping it stops vLLM's engine
cores too. The child watches its parent: if the actor process dies (kill -9, node loss) the child
kills its whole group, so no engine outlives its actor. If the child dies, the actor process exits
and Ray restarts the actor (``max_restarts``): Ray does the supervision. A restarted producer
resends what its outbox holds; a restarted learner resumes from its last checkpoint on the same
ports, so producers reconnect by themselves.

A ``ProducerActor`` whose index is the dedicated evaluator's (``eval.producer: dedicated``, index
``num_producers``) runs the evaluator instead (``pipeline.producer.main.producer_entry``).

``LearnerActor`` picks the learner's ports on its node's address and serves its snapshot files to
other nodes (``sync.serve_stream``); ``ProducerActor`` k connects producer k to the learner's
address and, off the learner's node, streams each version into its own node
(``sync.stream_from``). Actors on the driver's node (or with ``launch.shared_run_dir``) write into
``run_dir``; others into a directory of their node (``role_workdir``), which the driver mirrors.
Each actor's console (which Ray brings to the driver's) shows what the local launcher's console
would show of its role.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import yaml

from pipeline.config import RunConfig, flatten, load_config

log = logging.getLogger("pipeline")

KEY_FILES = ("server.key", "server.key_secret", "client.key", "client.key_secret")
PRODUCER_KEY_FILES = ("server.key", "client.key", "client.key_secret")
OLD_CHILD_WAIT_S = 30.0  # a dead actor's child kills its group 5 s after noticing
VERBOSE_ENV = "PIPELINE_GRPO_VERBOSE"  # the driver's --verbose, for the actors' consoles


def role_workdir(run_dir: str, same_as_driver: bool) -> Path:
    """The role's run_dir on this node: the driver's when it is visible here, else a directory
    of this node named after it (the same on a restart, so outboxes and checkpoints survive)."""
    if same_as_driver:
        return Path(run_dir)
    key = hashlib.sha1(run_dir.encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / "pipeline-grpo-ray" / f"{Path(run_dir).name}-{key}"


def _write_keys(files: dict[str, bytes]) -> Path:
    """The run's keys in a private directory of this node (0700, files 0600)."""
    d = Path(tempfile.mkdtemp(prefix="pipeline-keys-"))
    for name, data in files.items():
        fd = os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
    return d


def _watch_parent(parent: int, keys_dir: str) -> None:
    """In the child: when the actor process is gone (kill -9, node loss), remove the key copy
    and kill this process group (the role and its vLLM engine cores) after a short grace for
    PDEATHSIG's SIGTERM."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        shutil.rmtree(keys_dir, ignore_errors=True)
        time.sleep(5.0)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _learner_child(parent: int, cfg_dict: dict, model_path: str, resume: bool) -> None:
    from pipeline.launch.placement import learner_gpu_env
    from pipeline.learner.main import learner_entry

    _watch_parent(parent, cfg_dict["curve_keys"])
    learner_entry(cfg_dict, model_path, resume, learner_gpu_env(cfg_dict.get("learner_gpus", "")),
                  log_to_file=True)


def _producer_child(parent: int, cfg_dict: dict, model_path: str, index: int) -> None:
    from pipeline.launch.placement import producer_gpu_env
    from pipeline.producer.main import producer_entry

    _watch_parent(parent, cfg_dict["curve_keys"])
    producer_entry(cfg_dict, model_path, index,
                   producer_gpu_env(cfg_dict.get("producer_gpus", []), index), log_to_file=True)


def _local_model(model_path: str, cfg: RunConfig) -> str:
    """The driver's model directory when this node sees it, else the model built or converted
    here ('tiny', 'smollm2-135m'); a plain HF directory must exist on every node."""
    if (Path(model_path) / "config.json").is_file():
        return model_path
    from pipeline.models import resolve_model

    return str(resolve_model(cfg.model.path, Path(tempfile.gettempdir()) / "pipeline-models"))


class RoleActor:
    """What both actors do: start the child, exit the actor when it dies unexpectedly (Ray then
    restarts the actor), stop it in order, hand files back to the driver."""

    name = "role"

    def __init__(self) -> None:
        import ray

        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        with warnings.catch_warnings():  # Ray's own property trips its deprecation warning
            warnings.simplefilter("ignore", DeprecationWarning)
            self.restarted = ctx.was_current_actor_reconstructed
        # This node's address as the cluster knows it (the machine may have several).
        self.ip: str = next(
            n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == self.node_id
        )
        self.proc: Any = None
        self.stopping = False
        self.keys_dir: Path | None = None
        self.workdir = Path(".")
        self.tag = "role"
        self.log_name = "role.log"  # the child's file under workdir/logs (pipeline.procs)

    def _wait_previous(self, tag: str) -> None:
        """On a restart: wait until the child of the actor's previous incarnation is gone. It may
        still hold ports, write a checkpoint on its way out (SIGTERM when its actor died), append
        to the outbox or use shared memory; the new child starts from what it left."""
        import psutil

        self.tag = tag
        record = self.workdir / f".ray-child-{tag}.json"
        if not (self.restarted and record.is_file()):
            return
        old = json.loads(record.read_text())
        with contextlib.suppress(psutil.Error):
            child = psutil.Process(old["pid"])
            if abs(child.create_time() - old["created"]) < 0.01:
                log.warning("%s: waiting for the previous child (pid %d)", self.name, child.pid)
                try:
                    child.wait(OLD_CHILD_WAIT_S)
                except psutil.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(child.pid, signal.SIGKILL)
                    child.wait(10)

    def _start(self, proc: Any) -> None:
        import psutil

        from pipeline.launch.console import LogFollower

        self.proc = proc
        # The child writes everything to its log file; this actor's console (which Ray brings to
        # the driver's) gets what the local launcher's console would show of it.
        follower = LogFollower(self.workdir / "logs", verbose=os.environ.get(VERBOSE_ENV) == "1",
                               only=(self.log_name,))
        proc.start()
        threading.Thread(target=self._follow, args=(follower,), name="log-follow",
                         daemon=True).start()
        with contextlib.suppress(psutil.Error):
            created = psutil.Process(proc.pid).create_time()
            record = self.workdir / f".ray-child-{self.tag}.json"
            record.write_text(json.dumps({"pid": proc.pid, "created": created}))
        threading.Thread(target=self._monitor, name="child-monitor", daemon=True).start()

    def _follow(self, follower: Any) -> None:
        while self.proc.exitcode is None:
            with contextlib.suppress(OSError):
                follower.pump()
            time.sleep(0.5)
        with contextlib.suppress(OSError):
            follower.pump(final=True)

    def _monitor(self) -> None:
        proc = self.proc
        proc.join()
        code = proc.exitcode
        if self.stopping or code == 0:
            return
        log.error(
            "%s exited with code %s; the actor exits so that Ray restarts it", self.name, code
        )
        self._cleanup()
        os._exit(1)

    # Whether stop() signals the child's whole group first. A producer is signalled alone: it
    # aborts its requests and shuts its engine down in order (the engine core stops its
    # workers); a signal to its group would kill vLLM's workers under a live engine core.
    stop_group_first = True

    def _kill(self, sig: int, group: bool = True) -> None:
        """``sig`` once to the child's group (the child and its engines; ``group``), or to the
        child alone (always before it has made its group). Once: a second SIGINT would interrupt
        the learner's final checkpoint (the first cancels its main task, the next raises
        KeyboardInterrupt)."""
        if self.proc is None or self.proc.pid is None:
            return
        if not group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.proc.pid, sig)
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.proc.pid, sig)

    def _cleanup(self) -> None:
        if self.keys_dir is not None:
            shutil.rmtree(self.keys_dir, ignore_errors=True)

    def info(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "ip": self.ip,
            "pid": self.proc.pid if self.proc else None,
            "actor_pid": os.getpid(),
            "workdir": str(self.workdir),
        }

    def poll(self) -> dict[str, Any]:
        return {
            "pid": self.proc.pid,
            "exit": self.proc.exitcode,
            "node_id": self.node_id,
            "ip": self.ip,
        }

    def stop(self, sig: int, grace_s: float) -> int | None:
        """Signal the child (its group), wait ``grace_s``, then kill what is left."""
        self.stopping = True
        self._kill(sig, group=self.stop_group_first)
        self.proc.join(grace_s)
        self._kill(signal.SIGKILL)
        self.proc.join(5)
        from pipeline.procs import wait_group_gone

        wait_group_gone(self.proc.pid)
        self._cleanup()
        return self.proc.exitcode

    def files(self, under: str = "") -> list[tuple[str, int]]:
        """Files of this role's workdir (relative paths and sizes), for the driver's mirror."""
        root = self.workdir / under
        if not root.is_dir():
            return []
        return sorted(
            (str(p.relative_to(self.workdir)), p.stat().st_size)
            for p in root.rglob("*")
            if p.is_file() and not p.name.endswith(".sock")
        )

    def read(self, rel: str, offset: int = 0, size: int = -1) -> bytes:
        path = (self.workdir / rel).resolve()
        if self.workdir.resolve() not in path.parents:
            raise PermissionError(f"{rel} is outside the run's directory")
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read(size)


class LearnerActor(RoleActor):
    """The learner on its node: its ports on the node's address (the same after a restart, so
    producers reconnect alone), its config with them, and the learner as its child."""

    name = "learner"

    def __init__(
        self,
        cfg_dict: dict,
        model_path: str,
        keys: dict[str, bytes],
        resume: bool,
        driver_node: str,
    ):
        super().__init__()
        cfg = load_config(overrides=flatten(cfg_dict))
        same = self.node_id == driver_node or cfg.launch.shared_run_dir
        self.workdir = role_workdir(cfg.run_dir, same)
        if not same and not resume and not self.restarted:
            shutil.rmtree(self.workdir, ignore_errors=True)  # an earlier run of this run_dir
        self.workdir.mkdir(parents=True, exist_ok=True)
        ports = self._ports()
        self.keys_dir = _write_keys({k: keys[k] for k in KEY_FILES})
        self.same = same
        cfg_dict = self._bound_config(cfg_dict, ports)
        self.log_name = "learner.log"
        # This actor owns what its learner leaves in /dev/shm (pipeline.owner): the child
        # inherits the tag.
        from pipeline.launch.shm import reclaim_dead_owners
        from pipeline.owner import OWNER_ENV, owner_tag

        reclaim_dead_owners()  # what a killed run left in this node's /dev/shm
        os.environ[OWNER_ENV] = owner_tag()
        self.endpoints = {
            "addr": cfg_dict["addr"],
            "stream": cfg_dict["sync"]["serve_stream"],
            "ip": self.ip,
        }
        model_path = _local_model(model_path, cfg)
        from pipeline.learner.checkpoint import latest_checkpoint

        self._wait_previous("learner")
        resume = resume or (self.restarted and latest_checkpoint(self.workdir) is not None)
        if self.restarted:
            log.warning(
                "learner actor restarted by Ray%s", " from its last checkpoint" if resume else ""
            )
        self._start(self._child(cfg, cfg_dict, model_path, resume))

    def _ports(self) -> dict[str, int]:
        """The learner's ports on this node's address: those of the previous incarnation on a
        restart (producers reconnect to them by themselves), else free ones, recorded."""
        from buffer.ports import free_port, free_tcp_port_pair

        ports_file = self.workdir / ".ray-learner.json"
        if self.restarted and ports_file.is_file():
            return json.loads(ports_file.read_text())
        ports = {"learner": free_tcp_port_pair(self.ip), "stream": free_port(self.ip)}
        ports_file.write_text(json.dumps(ports))
        return ports

    def _bound_config(self, cfg_dict: dict, ports: dict[str, int]) -> dict:
        """The run's config for this node, written to the workdir: its directory, the learner
        bound on this node's address, the node's copy of the keys. The learner serves its own
        snapshot files to producers on other nodes (sync.serve_stream), encrypted with the
        run's keys."""
        ip = self.ip
        cfg_dict = dict(
            cfg_dict,
            run_dir=str(self.workdir),
            addr=f"tcp://{ip}:{ports['learner']}",
            curve_keys=str(self.keys_dir),
            insecure=False,
            sync=dict(cfg_dict["sync"], serve_stream=f"tcp://{ip}:{ports['stream']}"),
        )
        (self.workdir / "config.yaml").write_text(yaml.safe_dump(cfg_dict, sort_keys=False))
        return cfg_dict

    @staticmethod
    def _child(cfg: RunConfig, cfg_dict: dict, model_path: str, resume: bool) -> Any:
        """The learner process: ``accelerate launch`` for several ranks (its launcher has
        PDEATHSIG set: it stops its ranks when the actor dies), else one spawned process."""
        if cfg.train.learner_processes > 1 or cfg.train.accelerate_config:
            from pipeline.launch.local import LaunchedLearner

            run_cfg = load_config(overrides=flatten(cfg_dict))
            return _PopenProc(LaunchedLearner(run_cfg, model_path, resume))
        return mp.get_context("spawn").Process(
            target=_learner_child,
            name="learner",
            args=(os.getpid(), cfg_dict, model_path, resume),
        )

    def get_endpoints(self) -> dict[str, Any]:
        return self.info() | self.endpoints | {"same_dir": self.same}


class _PopenProc:
    """``LaunchedLearner`` (accelerate launch) behind the slice of ``mp.Process`` RoleActor uses."""

    def __init__(self, learner: Any):
        self.learner = learner

    def start(self) -> None:
        self.learner.start()

    @property
    def pid(self) -> int | None:
        return self.learner.pid

    @property
    def exitcode(self) -> int | None:
        return self.learner.exitcode

    def join(self, timeout: float | None = None) -> None:
        self.learner.join(timeout)


class ProducerActor(RoleActor):
    """Producer ``index`` on its node: its shared memory reclaimed and recorded, its config
    pointed at the learner (streaming snapshots off the learner's node), the producer as its
    child."""

    stop_group_first = False  # see RoleActor.stop_group_first

    def __init__(
        self,
        cfg_dict: dict,
        model_path: str,
        index: int,
        keys: dict[str, bytes],
        learner: Any,
        driver_node: str,
        resume: bool,
    ):
        """``learner``: the learner actor; its endpoints are asked for here (again after a
        restart of either actor), so producers start while the learner does."""
        super().__init__()
        import ray

        learner = ray.get(learner.get_endpoints.remote())
        from pipeline.schedule import display_name, process_name

        self.name = display_name(cfg_dict, index)
        self.log_name = f"{process_name(cfg_dict, index)}.log"
        from pipeline.owner import OWNER_ENV, owner_tag

        os.environ[OWNER_ENV] = owner_tag()  # owns its engines' shared memory (pipeline.owner)
        from pipeline.producer.rewards.ray_replicas import NODE_IP_ENV

        os.environ[NODE_IP_ENV] = self.ip  # where its ray rewards' client joins the cluster
        cfg = load_config(overrides=flatten(cfg_dict))
        same = self.node_id == driver_node or cfg.launch.shared_run_dir
        self.workdir = role_workdir(cfg.run_dir, same)
        self.shm_before = self._reclaim_shm(index, resume)
        self.keys_dir = _write_keys(keys)
        cfg_dict = self._connected_config(cfg, cfg_dict, learner)
        model_path = _local_model(model_path, cfg)
        self._start(
            mp.get_context("spawn").Process(
                target=_producer_child,
                name=f"producer{index}",
                args=(os.getpid(), cfg_dict, model_path, index),
            )
        )
        threading.Thread(target=self._record_segments, name="shm-record", daemon=True).start()

    def leave(self) -> None:
        """Leave an elastic run cleanly (``pipeline-train scale``): SIGUSR1 to the producer
        alone; it exits with code 0 once its groups are in the learner's checkpoint."""
        self._kill(signal.SIGUSR1, group=False)

    def _reclaim_shm(self, index: int, resume: bool) -> set[str]:
        """Reclaim what a killed engine of an earlier incarnation (or a killed run) left in this
        node's /dev/shm, against the segments that existed before the first incarnation started
        (recorded on this node); returns those segments. A fresh run also drops an earlier
        run's outbox, which it must not resend."""
        from pipeline.launch.shm import list_segments, reclaim_dead_owners, reclaim_orphans

        out = self.workdir / "producers"
        out.mkdir(parents=True, exist_ok=True)
        shm_file = out / f".shm-before-p{index}.json"
        self._wait_previous(f"p{index}")
        reclaim_dead_owners()  # what a killed run (or driver) left in this node's /dev/shm
        if self.restarted and shm_file.is_file():
            reclaim_orphans(set(json.loads(shm_file.read_text())))
            log.warning("%s actor restarted by Ray", self.name)
        else:
            shm_file.write_text(json.dumps(sorted(list_segments())))
            if not resume:  # a fresh run must not resend an earlier run's outbox
                for stale in out.glob(f"p{index}-*.wal"):
                    stale.unlink()
        return set(json.loads(shm_file.read_text()))

    def _connected_config(self, cfg: RunConfig, cfg_dict: dict, learner: dict) -> dict:
        """The run's config for this node: its directory, the learner's address, the node's copy
        of the keys, and the learner's snapshot stream when weights are streamed here."""
        stream = cfg.launch.stream_weights == "always" or (
            cfg.launch.stream_weights == "auto" and self.node_id != learner["node_id"]
        )
        sync = dict(cfg_dict["sync"], stream_from=learner["stream"] if stream else "")
        return dict(
            cfg_dict,
            run_dir=str(self.workdir),
            addr=learner["addr"],
            curve_keys=str(self.keys_dir),
            insecure=False,
            sync=sync,
        )

    def _record_segments(self) -> None:
        """Keep a record of the segments its engine made, under this actor's owner tag: if the
        actor is killed with its engine (kill -9, the driver gone), the next run on this node,
        or the private node's guard, reclaims them (pipeline.launch.shm.reclaim_dead_owners)."""
        from pipeline.launch.shm import record_segments

        known: set[str] | None = None
        while not self.stopping:
            with contextlib.suppress(OSError):
                known = record_segments(self.shm_before, known=known)
            time.sleep(2.0)

    def _cleanup(self) -> None:
        super()._cleanup()
        from pipeline.launch.shm import forget_record, reclaim_orphans

        with contextlib.suppress(Exception):
            reclaim_orphans(self.shm_before)
            forget_record()
