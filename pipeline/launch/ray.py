"""The Ray launcher (``pipeline-train --launcher ray``): the learner and every producer as Ray
actors placed on a cluster, with ZeroMQ still carrying rollout groups, control and weights.

What runs where:
- the driver (this process) connects to the cluster (``launch.ray_address``) or starts a private
  single-node instance; makes the run's CurveZMQ keys in memory; reserves a placement group for
  the learner (one bundle: all its ranks on one node) and one for the producers (a bundle each,
  ``launch.producer_strategy``, SPREAD by default); then starts the actors and watches them;
- ``LearnerActor`` picks the learner's ports on its node's address (found by the driver through
  the actor, never typed) and runs the learner as its child process, which binds them and serves
  its snapshot files to other nodes (``sync.serve_stream``);
- ``ProducerActor`` k runs producer k as its child process, connected to the learner's address;
  off the learner's node it streams each version into its own node (``sync.stream_from``).

Each actor runs its role as a child in its own process group (the same entry points as the local
launcher), so stopping it stops vLLM's engine cores too. The child watches its parent: if the actor
process dies (kill -9, node loss) the child kills its whole group, so no engine outlives its actor.
If the child dies, the actor process exits, and Ray restarts the actor (``max_restarts`` from
``--max-producer-restarts`` / ``--max-learner-restarts``): Ray does the supervision. A restarted
producer resends what its outbox holds; a restarted learner resumes from its last checkpoint on the
same ports, so producers reconnect by themselves.

Files: actors on the driver's node (or with ``launch.shared_run_dir``) write into ``run_dir``;
others into a directory of their node, and the driver mirrors the learner's metrics into
``run_dir`` as they are written and the small files (summary plot, checkpoint state, producers'
sent logs, every role's ``logs/<process>.log``) at the end. Consoles: each role writes everything
to its log file, as under the local launcher; its actor shows on the driver's console (through
Ray) what the local launcher's console would show of it (every line with ``--verbose``).
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

from pipeline.config import ConfigError, RunConfig, flatten, load_config, to_dict
from pipeline.launch.ray_cluster import _FORWARDED, _connect, _import_ray, start_private_node

log = logging.getLogger("pipeline")

MIRROR_MAX_BYTES = 64 << 20  # files the driver copies back at the end (checkpoint weights stay)
KEY_FILES = ("server.key", "server.key_secret", "client.key", "client.key_secret")
OLD_CHILD_WAIT_S = 30.0  # a dead actor's child kills its group 5 s after noticing
PRODUCER_KEY_FILES = ("server.key", "client.key", "client.key_secret")
VERBOSE_ENV = "PIPELINE_GRPO_VERBOSE"  # the driver's --verbose, for the actors' consoles


# ---------------------------------------------------------------- shared by both actors


def _workdir(run_dir: str, same_as_driver: bool) -> Path:
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
    from pipeline.launch.local import learner_entry

    _watch_parent(parent, cfg_dict["curve_keys"])
    learner_entry(cfg_dict, model_path, resume, log_to_file=True)


def _producer_child(parent: int, cfg_dict: dict, model_path: str, index: int) -> None:
    from pipeline.launch.local import producer_entry

    _watch_parent(parent, cfg_dict["curve_keys"])
    producer_entry(cfg_dict, model_path, index, log_to_file=True)


def _local_model(model_path: str, cfg: RunConfig) -> str:
    """The driver's model directory when this node sees it, else the model built or converted
    here ('tiny', 'smollm2-135m'); a plain HF directory must exist on every node."""
    if (Path(model_path) / "config.json").is_file():
        return model_path
    from pipeline.models import resolve_model

    return str(resolve_model(cfg.model.path, Path(tempfile.gettempdir()) / "pipeline-models"))


class _Role:
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


class LearnerActor(_Role):
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
        from buffer.transport import free_tcp_port_pair
        from pipeline.launch.ray_node import free_port

        cfg = load_config(overrides=flatten(cfg_dict))
        same = self.node_id == driver_node or cfg.launch.shared_run_dir
        self.workdir = _workdir(cfg.run_dir, same)
        ports_file = self.workdir / ".ray-learner.json"
        if not same and not resume and not self.restarted:
            shutil.rmtree(self.workdir, ignore_errors=True)  # an earlier run of this run_dir
        self.workdir.mkdir(parents=True, exist_ok=True)
        ip = self.ip
        if self.restarted and ports_file.is_file():  # same ports: producers reconnect alone
            ports = json.loads(ports_file.read_text())
        else:
            ports = {"learner": free_tcp_port_pair(ip), "stream": free_port(ip)}
            ports_file.write_text(json.dumps(ports))
        self.keys_dir = _write_keys({k: keys[k] for k in KEY_FILES})
        self.same = same
        # The learner serves its own snapshot files to producers on other nodes
        # (sync.serve_stream), encrypted with the run's keys.
        cfg_dict = dict(
            cfg_dict,
            run_dir=str(self.workdir),
            addr=f"tcp://{ip}:{ports['learner']}",
            curve_keys=str(self.keys_dir),
            insecure=False,
            sync=dict(cfg_dict["sync"], serve_stream=f"tcp://{ip}:{ports['stream']}"),
        )
        (self.workdir / "config.yaml").write_text(yaml.safe_dump(cfg_dict, sort_keys=False))
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
            "ip": ip,
        }
        model_path = _local_model(model_path, cfg)
        from pipeline.learner.checkpoint import latest_checkpoint

        self._wait_previous("learner")
        resume = resume or (self.restarted and latest_checkpoint(self.workdir) is not None)
        if self.restarted:
            log.warning(
                "learner actor restarted by Ray%s", " from its last checkpoint" if resume else ""
            )
        ctx = mp.get_context("spawn")
        if cfg.train.learner_processes > 1 or cfg.train.accelerate_config:
            from pipeline.launch.local import LaunchedLearner

            run_cfg = load_config(overrides=flatten(cfg_dict))
            # accelerate's launcher has PDEATHSIG set: it stops its ranks when the actor dies.
            self._start(_PopenProc(LaunchedLearner(run_cfg, model_path, resume)))
        else:
            self._start(
                ctx.Process(
                    target=_learner_child,
                    name="learner",
                    args=(os.getpid(), cfg_dict, model_path, resume),
                )
            )

    def get_endpoints(self) -> dict[str, Any]:
        return self.info() | self.endpoints | {"same_dir": self.same}


class _PopenProc:
    """``LaunchedLearner`` (accelerate launch) behind the slice of ``mp.Process`` _Role uses."""

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


class ProducerActor(_Role):
    stop_group_first = False  # see _Role.stop_group_first

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
        from pipeline.launch.shm import list_segments, reclaim_dead_owners, reclaim_orphans

        self.name = f"producer {index}"
        self.log_name = f"producer-{index}.log"
        from pipeline.owner import OWNER_ENV, owner_tag

        os.environ[OWNER_ENV] = owner_tag()  # owns its engines' shared memory (pipeline.owner)
        from pipeline.producer.ray_rewards import NODE_IP_ENV

        os.environ[NODE_IP_ENV] = self.ip  # where its ray rewards' client joins the cluster
        cfg = load_config(overrides=flatten(cfg_dict))
        same = self.node_id == driver_node or cfg.launch.shared_run_dir
        self.workdir = _workdir(cfg.run_dir, same)
        out = self.workdir / "producers"
        out.mkdir(parents=True, exist_ok=True)
        # Segments a killed engine of an earlier incarnation left: reclaimed against what
        # existed before the first incarnation started (recorded on this node).
        shm_file = out / f".shm-before-p{index}.json"
        self._wait_previous(f"p{index}")
        reclaim_dead_owners()  # what a killed run (or driver) left in this node's /dev/shm
        if self.restarted and shm_file.is_file():
            reclaim_orphans(set(json.loads(shm_file.read_text())))
            log.warning("producer %d actor restarted by Ray", index)
        else:
            shm_file.write_text(json.dumps(sorted(list_segments())))
            if not resume:  # a fresh run must not resend an earlier run's outbox
                for stale in out.glob(f"p{index}-*.wal"):
                    stale.unlink()
        self.shm_before = set(json.loads(shm_file.read_text()))
        self.keys_dir = _write_keys(keys)
        stream = cfg.launch.stream_weights == "always" or (
            cfg.launch.stream_weights == "auto" and self.node_id != learner["node_id"]
        )
        sync = dict(cfg_dict["sync"], stream_from=learner["stream"] if stream else "")
        cfg_dict = dict(
            cfg_dict,
            run_dir=str(self.workdir),
            addr=learner["addr"],
            curve_keys=str(self.keys_dir),
            insecure=False,
            sync=sync,
        )
        model_path = _local_model(model_path, cfg)
        self._start(
            mp.get_context("spawn").Process(
                target=_producer_child,
                name=f"producer{index}",
                args=(os.getpid(), cfg_dict, model_path, index),
            )
        )
        threading.Thread(target=self._record_segments, name="shm-record", daemon=True).start()

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


# ---------------------------------------------------------------- driver


def make_keys() -> dict[str, bytes]:
    """The run's CurveZMQ keys, made by the driver: the certificate files of the roles'
    ``curve_keys`` directories."""
    from buffer.transport import generate_curve_keys

    with tempfile.TemporaryDirectory(prefix="pipeline-keys-") as d:  # 0700, removed at once
        generate_curve_keys(d)
        return {name: (Path(d) / name).read_bytes() for name in KEY_FILES}


def _bundle(cpus: float, gpus: float, resources: dict[str, float]) -> dict[str, float]:
    b = {"CPU": float(cpus), "GPU": float(gpus)} | {k: float(v) for k, v in resources.items()}
    return {k: v for k, v in b.items() if v > 0}


def _missing(ray: Any, bundle: dict[str, float], labels: dict[str, str]) -> str:
    """Why no node fits ``bundle``: what the cluster lacks, in one phrase."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    total = ray.cluster_resources()
    for name, amount in bundle.items():
        if total.get(name, 0) < amount:
            have = total.get(name, 0)
            return (
                f"the cluster has {have:g} {name} in all"
                if have
                else f"no node has resource {name!r}"
            ) + f" (needs {amount:g})"
    fits = [n for n in nodes if all(n["Resources"].get(k, 0) >= v for k, v in bundle.items())]
    if not fits:
        return f"no single node has all of {bundle}"
    if labels:
        return f"no node with {bundle} matches the labels {labels}"
    return f"the nodes with {bundle} are busy (resources held by other jobs)"


def _place(
    ray: Any,
    name: str,
    bundles: list[dict[str, float]],
    strategy: str,
    labels: dict[str, str],
    timeout_s: float,
) -> Any:
    from ray.util.placement_group import placement_group, remove_placement_group

    if not all(bundles):
        raise ConfigError(
            f"launch: the {name}'s bundle reserves nothing (set "
            f"launch.{name}_num_cpus > 0 or a resource)"
        )
    selector = [dict(labels) for _ in bundles] if labels else None
    pg = placement_group(bundles, strategy=strategy, bundle_label_selector=selector)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        why = _missing(ray, bundles[0], labels)
        if strategy == "STRICT_SPREAD" and len(bundles) > 1:
            why += f"; STRICT_SPREAD needs {len(bundles)} nodes that fit it"
        raise ConfigError(
            f"launch: cannot place the {name} within {timeout_s:.0f}s: {why} "
            f"(launch.{name}_num_cpus/_num_gpus/_resources/_labels)"
        ) from None
    return pg


class _Mirror:
    """Copies the learner's files from its node into the driver's run_dir."""

    def __init__(self, ray: Any, learner: Any, run_dir: Path):
        self.ray, self.learner, self.run_dir = ray, learner, run_dir
        self.offset = 0

    def metrics(self) -> None:
        with contextlib.suppress(Exception):
            data = self.ray.get(self.learner.read.remote("metrics.jsonl", self.offset), timeout=10)
            if data:
                with open(self.run_dir / "metrics.jsonl", "ab") as fh:
                    fh.write(data)
                self.offset += len(data)

    def final(self) -> None:
        self.metrics()
        files = self.ray.get(self.learner.files.remote(), timeout=30)
        left = []
        for rel, size in files:
            if rel in ("metrics.jsonl", "config.yaml") or rel.startswith(".ray-"):
                continue
            if size > MIRROR_MAX_BYTES or rel.startswith("snapshots/"):
                left.append(rel)
                continue
            dest = self.run_dir / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(self.ray.get(self.learner.read.remote(rel), timeout=60))
        if left:
            log.info("left on the learner's node: %d large file(s), e.g. %s", len(left), left[0])


def run(
    cfg: RunConfig,
    *,
    resume: bool = False,
    max_producer_restarts: int = 0,
    max_learner_restarts: int = 0,
    verbose: bool = False,
) -> int:
    """Run the whole job on Ray; returns an exit code (like ``pipeline.launch.local.run``).
    ``verbose``: the actors' consoles show every line of their roles' logs, not only what the
    local launcher's console shows."""
    from pipeline.launch.local import prepare, set_aside_previous_run

    # Every actor's lines on the console, as with the local launcher (Ray folds similar lines
    # of different actors into one by default).
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray = _import_ray()
    if cfg.addr:
        raise ConfigError(
            "addr: the Ray launcher binds the learner on its node's address "
            "itself; leave addr empty"
        )
    if cfg.producer_gpus or cfg.learner_gpus:
        raise ConfigError(
            "producer_gpus/learner_gpus: Ray assigns GPUs; use "
            "launch.producer_num_gpus / launch.learner_num_gpus"
        )
    # The private Ray node (if any) starts while the config, model and rewards are checked.
    node = start_private_node(cfg)
    try:
        model_path = prepare(cfg, "all")
        run_dir = Path(cfg.run_dir).resolve()
        cfg.run_dir = str(run_dir)
        if not resume:
            set_aside_previous_run(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if not resume:
            for stale in (run_dir / "producers").glob("*.wal"):
                stale.unlink()
        cfg_dict = to_dict(cfg)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg_dict, sort_keys=False))
        t0 = time.monotonic()
        node = _connect(ray, cfg, node)
    except BaseException:
        if node is not None:
            node.stop()
        raise
    lc = cfg.launch
    pgs: list[Any] = []
    actors: list[Any] = []
    learner = None
    producers: dict[int, Any] = {}
    watched: _Producers | None = None
    mirror: _Mirror | None = None
    reward_actors: list[Any] = []
    code = 0
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        driver_node = ray.get_runtime_context().get_node_id()
        log.info(
            "ray: connected in %.1fs (%d nodes)",
            time.monotonic() - t0,
            sum(1 for n in ray.nodes() if n.get("Alive")),
        )
        lb = _bundle(lc.learner_num_cpus, lc.learner_num_gpus, lc.learner_resources)
        pb = _bundle(lc.producer_num_cpus, lc.producer_num_gpus, lc.producer_resources)
        pgs.append(_place(ray, "learner", [lb], "STRICT_PACK", lc.learner_labels, lc.ray_timeout_s))
        pgs.append(
            _place(
                ray,
                "producer",
                [pb] * cfg.num_producers,
                lc.producer_strategy,
                lc.producer_labels,
                lc.ray_timeout_s,
            )
        )
        keys = make_keys()
        producer_keys = {k: keys[k] for k in PRODUCER_KEY_FILES}
        env = {"env_vars": {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED)}
               | {VERBOSE_ENV: "1" if verbose else "0"}}
        from pipeline.producer.ray_rewards import HANDLE_ENV, ray_specs, start_replicas

        if ray_specs(cfg.rewards.specs):  # executor: ray, shared by every producer
            handle, reward_actors = start_replicas(
                ray, cfg.rewards.specs, timeout_s=lc.ray_timeout_s, runtime_env=env
            )
            env["env_vars"][HANDLE_ENV] = json.dumps(handle)

        def opts(pg: Any, i: int, cpus: float, gpus: float, res: dict, restarts: int) -> dict:
            return {
                "num_cpus": cpus,
                "num_gpus": gpus,
                "resources": dict(res),
                "max_restarts": restarts,
                "max_task_retries": 0,
                "runtime_env": env,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=i
                ),
            }

        learner = (
            ray.remote(LearnerActor)
            .options(
                name=None,
                **opts(
                    pgs[0],
                    0,
                    lc.learner_num_cpus,
                    lc.learner_num_gpus,
                    lc.learner_resources,
                    max_learner_restarts,
                ),
            )
            .remote(cfg_dict, model_path, keys, resume, driver_node)
        )
        actors.append(learner)
        # Producers start beside the learner: each actor asks the learner for its endpoints.
        for i in range(cfg.num_producers):
            producers[i] = (
                ray.remote(ProducerActor)
                .options(
                    **opts(
                        pgs[1],
                        i,
                        lc.producer_num_cpus,
                        lc.producer_num_gpus,
                        lc.producer_resources,
                        max_producer_restarts,
                    )
                )
                .remote(cfg_dict, model_path, i, producer_keys, learner, driver_node, resume)
            )
            actors.append(producers[i])
        ep = ray.get(learner.get_endpoints.remote())
        log.info(
            "ray: learner on node %s (%s), actor pid %d, learner pid %d, rollouts at %s, "
            "snapshots streamed from %s",
            ep["node_id"][:12],
            ep["ip"],
            ep["actor_pid"],
            ep["pid"],
            ep["addr"],
            ep["stream"],
        )
        infos = ray.get([p.info.remote() for p in producers.values()])
        placement = {"learner": ep["node_id"]} | {
            f"producer{i}": info["node_id"] for i, info in zip(producers, infos, strict=True)
        }
        (run_dir / "placement.json").write_text(json.dumps(placement, indent=1))
        for i, info in zip(producers, infos, strict=True):
            log.info(
                "ray: producer %d on node %s (%s), actor pid %d, producer pid %d",
                i,
                info["node_id"][:12],
                info["ip"],
                info["actor_pid"],
                info["pid"],
            )
        mirror = None if ep["same_dir"] else _Mirror(ray, learner, run_dir)
        watched = _Producers(ray, producers, infos)
        movable = lc.shared_run_dir and max_learner_restarts > 0
        code = _watch(ray, learner, watched, mirror, ep["pid"], ep["node_id"], movable)
    except KeyboardInterrupt:
        code = code or 130
        log.warning("stopping: learner saves a checkpoint, producers shut down")
    finally:
        gone = watched.lost | watched.dead if watched is not None else set()
        _teardown(ray, learner, producers, pgs, run_dir, mirror, gone)
        if reward_actors:
            from pipeline.producer.ray_rewards import stop_replicas

            stop_replicas(ray, reward_actors)
        with contextlib.suppress(Exception):
            ray.shutdown()
        if node is not None:
            node.stop()
    return code


DEAD_CONFIRM = 3  # failed calls in a row before an actor counts as dead for good


def _dead(ray: Any, call: Any, tries: int = DEAD_CONFIRM) -> bool:
    """Whether an actor whose call just failed with RayActorError is dead for good: a call in
    flight when the actor's process dies fails even when Ray restarts the actor, so the call is
    repeated; one that is answered (or queued for the restarted actor) means it lives."""
    for _ in range(tries):
        time.sleep(1.0)
        try:
            ray.get(call(), timeout=5)
            return False
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            return False
        except ray.exceptions.RayError:
            continue
    return True


class _Producers:
    """The driver's view of the producer actors: one poll in flight each (never blocking the
    loop on an actor that waits for a node), restarts and lost nodes reported on the console."""

    def __init__(self, ray: Any, actors: dict[int, Any], infos: list[dict]):
        self.ray, self.actors = ray, actors
        self.pid = {i: info["pid"] for i, info in zip(actors, infos, strict=True)}
        self.node = {i: info["node_id"] for i, info in zip(actors, infos, strict=True)}
        self.ip = {i: info["ip"] for i, info in zip(actors, infos, strict=True)}
        self.calls: dict[int, Any] = {}
        self.lost: set[int] = set()  # node gone; Ray restarts it when a node fits its bundle
        self.dead: set[int] = set()  # for good
        self.nodes_checked = 0.0

    def check(self) -> bool:
        """False when the run must stop (a producer died for good other than by node loss, or
        no producer is left)."""
        ray = self.ray
        if time.monotonic() - self.nodes_checked > 1.0:
            self.nodes_checked = time.monotonic()
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            for i in sorted(set(self.actors) - self.lost - self.dead):
                if self.node[i] not in alive:
                    self.lost.add(i)
                    log.error(
                        "producer %d lost: its node %s (%s) left the cluster; the run goes on "
                        "with %d producer(s); Ray restarts it where its bundle fits, if restarts "
                        "are left (--max-producer-restarts)",
                        i,
                        self.node[i][:12],
                        self.ip[i],
                        len(self.actors) - len(self.lost) - len(self.dead),
                    )
        for i, actor in self.actors.items():
            if i in self.dead:
                continue
            ref = self.calls.get(i) or self.calls.setdefault(i, actor.poll.remote())
            done, _ = ray.wait([ref], timeout=0)
            if not done:
                continue
            del self.calls[i]
            try:
                st = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:
                continue
            except ray.exceptions.RayError as e:  # the actor died (or Ray's OOM killer)
                if i not in self.lost and not _dead(ray, actor.poll.remote):
                    continue
                self.dead.add(i)
                left = len(self.actors) - len(self.dead)
                alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
                if (i in self.lost or self.node[i] not in alive) and left:
                    log.error("producer %d is gone for good with its node; %d left", i, left)
                    continue
                log.error(
                    "producer %d died and Ray will not restart it (launch restarts exhausted): %s",
                    i,
                    str(e).splitlines()[0],
                )
                return False
            if st["pid"] != self.pid[i]:
                log.warning(
                    "producer %d restarted by Ray (pid %s -> %s) on node %s (%s)",
                    i,
                    self.pid[i],
                    st["pid"],
                    st["node_id"][:12],
                    st["ip"],
                )
                self.pid[i], self.node[i], self.ip[i] = st["pid"], st["node_id"], st["ip"]
                self.lost.discard(i)
        return True


def _watch(
    ray: Any,
    learner: Any,
    producers: _Producers,
    mirror: _Mirror | None,
    learner_pid: int,
    learner_node: str,
    learner_movable: bool,
) -> int:
    """Until the learner's child exits: mirror metrics, report restarts and lost producers, fail
    when Ray gives up on an actor or the learner's node (with its checkpoints) is gone."""
    while True:
        if not learner_movable and learner_node not in {
            n["NodeID"] for n in ray.nodes() if n.get("Alive")
        }:
            log.error(
                "the learner's node %s left the cluster with its checkpoints; stopping "
                "(--resume continues once the node is back; launch.shared_run_dir lets Ray "
                "restart the learner elsewhere)",
                learner_node[:12],
            )
            return 1
        try:
            st = ray.get(learner.poll.remote(), timeout=30)
        except ray.exceptions.ActorUnavailableError:
            time.sleep(1.0)  # being restarted by Ray
            continue
        except ray.exceptions.GetTimeoutError:
            continue
        except ray.exceptions.RayError as e:  # the actor died (or Ray's OOM killer)
            if not _dead(ray, learner.poll.remote):
                continue
            log.error(
                "the learner actor died and Ray will not restart it: %s", str(e).splitlines()[0]
            )
            return 1
        if st["pid"] != learner_pid:
            log.warning(
                "learner restarted by Ray (pid %s -> %s) on node %s (%s)",
                learner_pid,
                st["pid"],
                st["node_id"][:12],
                st["ip"],
            )
            learner_pid, learner_node = st["pid"], st["node_id"]
        if mirror is not None:
            mirror.metrics()
        if st["exit"] is not None:
            if st["exit"]:
                log.error("learner exited with code %d", st["exit"])
            return 1 if st["exit"] else 0
        if not producers.check():
            return 1
        time.sleep(0.5)


def _teardown(
    ray: Any,
    learner: Any,
    producers: dict[int, Any],
    pgs: list[Any],
    run_dir: Path,
    mirror: _Mirror | None = None,
    gone: set[int] = frozenset(),
) -> None:
    """Learner first (SIGINT: its final checkpoint, then its files come back to run_dir, on
    Ctrl-C too), then producers (their sent logs come back to run_dir/producers; those whose
    node is ``gone`` are not waited for), then the actors and placement groups."""
    from ray.util.placement_group import remove_placement_group

    if learner is not None:
        with contextlib.suppress(Exception):
            ray.get(learner.stop.remote(signal.SIGINT, 120.0), timeout=150)
        if mirror is not None:
            with contextlib.suppress(Exception):
                mirror.final()
    waits = []
    for i, actor in producers.items():
        if i not in gone:
            with contextlib.suppress(Exception):
                waits.append((actor, actor.stop.remote(signal.SIGTERM, 20.0)))
    for actor, ref in waits:
        with contextlib.suppress(Exception):
            ray.get(ref, timeout=40)
            if run_dir is not None:
                _copy_sent_logs(ray, actor, run_dir)
    for actor in [learner, *producers.values()]:
        if actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
    for pg in pgs:
        with contextlib.suppress(Exception):
            remove_placement_group(pg)


def _copy_sent_logs(ray: Any, actor: Any, run_dir: Path) -> None:
    """A producer's records of what it sent (and its outbox) into run_dir/producers, the
    conservation check's producer side (bench/soak.py tally), and its log into run_dir/logs."""
    info = ray.get(actor.info.remote(), timeout=10)
    if Path(info["workdir"]) == run_dir:
        return
    files = [*ray.get(actor.files.remote("producers"), timeout=10),
             *ray.get(actor.files.remote("logs"), timeout=10)]
    for rel, size in files:
        if rel.endswith((".jsonl", ".wal", ".log")) and size <= MIRROR_MAX_BYTES:
            dest = run_dir / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(ray.get(actor.read.remote(rel), timeout=30))
