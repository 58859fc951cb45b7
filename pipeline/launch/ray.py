"""The Ray launcher's driver (``pipeline-train --launcher ray``): the learner and every producer as
Ray actors (``pipeline.launch.ray_actors``) placed on a cluster, with ZeroMQ still carrying rollout
groups, control and weights.

The driver (this process) connects to the cluster (``launch.ray_address``) or starts a private
single-node instance; makes the run's CurveZMQ keys in memory; reserves a placement group for the
learner (one bundle: all its ranks on one node) and one for the producers (a bundle each,
``launch.producer_strategy``, SPREAD by default; ``pipeline.launch.ray_placement``); then starts
the actors and watches them. Ray restarts an actor whose role died (``max_restarts`` from
``--max-producer-restarts`` / ``--max-learner-restarts``); the driver reports restarts and lost
nodes, and stops the run when Ray gives up on an actor or the learner's node (with its
checkpoints) is gone. The dedicated evaluator (``eval.producer: dedicated``) is one more
producer actor with a producer's bundle, after the producers; when Ray gives up on it the run
goes on without evaluation (one line on the console).

Files: actors on the driver's node (or with ``launch.shared_run_dir``) write into ``run_dir``;
others into a directory of their node, and the driver mirrors the learner's metrics into
``run_dir`` as they are written and the small files (summary plot, checkpoint state, producers'
sent logs, every role's ``logs/<process>.log``) at the end. Consoles: each role writes everything
to its log file, as under the local launcher; its actor shows on the driver's console (through
Ray) what the local launcher's console would show of it (every line with ``--verbose``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from pipeline.config import RunConfig
from pipeline.launch.console import tell
from pipeline.launch.ray_actors import (
    KEY_FILES,
    PRODUCER_KEY_FILES,
    VERBOSE_ENV,
    LearnerActor,
    ProducerActor,
)
from pipeline.launch.ray_cluster import connect, forwarded_env, import_ray, start_private_node
from pipeline.launch.ray_placement import bundle, place
from pipeline.launch.ray_producers import ProducerWatch, dead_for_good
from pipeline.launch.scale import LAUNCHER_FILE, ScaleWatch, plan, record_launcher
from pipeline.options import ConfigError, to_dict
from pipeline.schedule import evaluator_index

log = logging.getLogger("pipeline")

MIRROR_MAX_BYTES = 64 << 20  # files the driver copies back at the end (checkpoint weights stay)


def make_keys() -> dict[str, bytes]:
    """The run's CurveZMQ keys, made by the driver: the certificate files of the roles'
    ``curve_keys`` directories."""
    from buffer.keys import generate_curve_keys

    with tempfile.TemporaryDirectory(prefix="pipeline-keys-") as d:  # 0700, removed at once
        generate_curve_keys(d)
        return {name: (Path(d) / name).read_bytes() for name in KEY_FILES}


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
    # 1. Ray itself, and the options Ray decides instead of the config.
    ray = _checked_ray(cfg)
    # 2. The private node (if any) starts while the config, model and rewards are checked; then
    #    the driver connects.
    node, model_path, connect_t0 = _prepare(ray, cfg, resume)
    driver = _Driver(ray, cfg, model_path, resume)
    code = 0
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        log.info(
            "ray: connected in %.1fs (%d nodes)",
            time.monotonic() - connect_t0,
            sum(1 for n in ray.nodes() if n.get("Alive")),
        )
        # 3. Placement groups for the learner and the producers, before any actor starts.
        driver.place()
        # 4. The actors' environment (and the replicas of executor: ray rewards), the actors.
        driver.start_actors(driver.actor_env(verbose), max_producer_restarts,
                            max_learner_restarts)
        # 5. Where each role runs, on the console and in run_dir/placement.json.
        learner_ep = driver.report_placement()
        # 6. Watch until the learner's child exits.
        code = driver.watch(learner_ep, movable=cfg.launch.shared_run_dir
                            and max_learner_restarts > 0)
    except KeyboardInterrupt:
        code = code or 130
        log.warning("stopping: learner saves a checkpoint, producers shut down")
    finally:
        # 7. Learner first (its final checkpoint), then producers, actors, placement groups,
        #    reward replicas, the connection and the private node.
        driver.teardown()
        if node is not None:
            node.stop()
    return code


def _checked_ray(cfg: RunConfig) -> Any:
    """The ray module, once the config leaves to Ray what Ray decides (addresses, GPUs)."""
    # Every actor's lines on the console, as with the local launcher (Ray folds similar lines
    # of different actors into one by default).
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray = import_ray()
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
    return ray


def _prepare(ray: Any, cfg: RunConfig, resume: bool) -> tuple[Any, str, float]:
    """Check the run (model, data, rewards) while the private node starts, set run_dir up
    (absolute, an earlier run set aside, its config written), connect. Returns the private node
    (or None), the model's path and when connecting began; the node is stopped on failure."""
    from pipeline.launch.local import check_fresh_run_space
    from pipeline.launch.preflight import prepare
    from pipeline.launch.run_dir import roster_for_launch, set_aside_previous_run

    node = start_private_node(cfg)
    try:
        model_path = prepare(cfg, "all")
        check_fresh_run_space(cfg, model_path, resume)
        run_dir = Path(cfg.run_dir).resolve()
        cfg.run_dir = str(run_dir)
        if not resume:
            set_aside_previous_run(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if not resume:
            for stale in (run_dir / "producers").glob("*.wal"):
                stale.unlink()
        roster_for_launch(run_dir, resume, cfg.num_producers)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        t0 = time.monotonic()
        node = connect(ray, cfg, node)
    except BaseException:
        if node is not None:
            node.stop()
        raise
    return node, model_path, t0


class _Driver:
    """What the driver started (placement groups, actors, reward replicas, the mirror), step by
    step, so that the teardown stops whatever of it exists."""

    def __init__(self, ray: Any, cfg: RunConfig, model_path: str, resume: bool):
        self.ray, self.cfg, self.model_path, self.resume = ray, cfg, model_path, resume
        self.cfg_dict = to_dict(cfg)
        self.run_dir = Path(cfg.run_dir)
        self.pgs: list[Any] = []
        self.learner: Any = None
        self.producers: dict[int, Any] = {}
        self.watched: ProducerWatch | None = None
        self.mirror: _Mirror | None = None
        self.reward_actors: list[Any] = []
        ev = cfg.eval
        self.evaluator = evaluator_index(cfg.producer_slots, ev.every, ev.producer)
        # The engines started now: the producers, then the dedicated evaluator (its index
        # follows every producer index an elastic run may add: RunConfig.producer_slots).
        self.starting = [*range(cfg.num_producers), *([] if self.evaluator is None
                                                      else [self.evaluator])]
        self.scale: ScaleWatch | None = ScaleWatch(self.run_dir) \
            if cfg.producer_slots > cfg.num_producers else None
        self.actor_opts: Any = None  # (pg, bundle, restarts) -> actor options, once started
        self.producer_args: tuple = ()

    def place(self) -> None:
        """Reserve the learner's bundle (all its ranks on one node) and the producers'."""
        lc, ray = self.cfg.launch, self.ray
        lb = bundle(lc.learner_num_cpus, lc.learner_num_gpus, lc.learner_resources)
        pb = bundle(lc.producer_num_cpus, lc.producer_num_gpus, lc.producer_resources)
        self.pgs.append(
            place(ray, "learner", [lb], "STRICT_PACK", lc.learner_labels, lc.ray_timeout_s)
        )
        self.pgs.append(
            place(
                ray,
                "producer",
                [pb] * len(self.starting),
                lc.producer_strategy,
                lc.producer_labels,
                lc.ray_timeout_s,
            )
        )

    def actor_env(self, verbose: bool) -> dict:
        """The actors' runtime env: this process's forwarded environment, ``--verbose``, and
        where the replicas of ``executor: ray`` rewards (shared by every producer) are, started
        here."""
        from pipeline.producer.rewards.ray_replicas import HANDLE_ENV, ray_specs, start_replicas

        env = {"env_vars": forwarded_env() | {VERBOSE_ENV: "1" if verbose else "0"}}
        if ray_specs(self.cfg.rewards.specs):
            handle, self.reward_actors = start_replicas(
                self.ray, self.cfg.rewards.specs, timeout_s=self.cfg.launch.ray_timeout_s,
                runtime_env=env,
            )
            env["env_vars"][HANDLE_ENV] = json.dumps(handle)
        return env

    def start_actors(self, env: dict, max_producer_restarts: int,
                     max_learner_restarts: int) -> None:
        """The learner actor, then the producers beside it: each producer actor asks the learner
        for its endpoints, so they start while the learner does."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        lc, ray = self.cfg.launch, self.ray
        driver_node = ray.get_runtime_context().get_node_id()
        keys = make_keys()
        producer_keys = {k: keys[k] for k in PRODUCER_KEY_FILES}

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

        self.learner = (
            ray.remote(LearnerActor)
            .options(name=None, **opts(self.pgs[0], 0, lc.learner_num_cpus, lc.learner_num_gpus,
                                       lc.learner_resources, max_learner_restarts))
            .remote(self.cfg_dict, self.model_path, keys, self.resume, driver_node)
        )
        self.actor_opts = lambda pg, b: opts(pg, b, lc.producer_num_cpus, lc.producer_num_gpus,
                                             lc.producer_resources, max_producer_restarts)
        self.producer_args = (producer_keys, self.learner, driver_node)
        for b, i in enumerate(self.starting):  # the producers, then the dedicated evaluator
            self.producers[i] = self._producer(self.pgs[1], b, i, self.resume)

    def _producer(self, pg: Any, bundle: int, i: int, resume: bool) -> Any:
        """Producer (or evaluator) actor ``i`` in bundle ``bundle`` of placement group ``pg``."""
        keys, learner, driver_node = self.producer_args
        return (self.ray.remote(ProducerActor).options(**self.actor_opts(pg, bundle))
                .remote(self.cfg_dict, self.model_path, i, keys, learner, driver_node, resume))

    def apply_scale(self) -> None:
        """A new ``pipeline-train scale`` request (``pipeline.launch.scale``): a joining
        producer gets a placement group of its own; one that leaves is told through its actor
        (SIGUSR1 to its child) and not restarted."""
        req = self.scale.poll() if self.scale is not None else None
        if req is None or self.watched is None:
            return
        todo = plan(req, self.watched.running(), self.cfg.producer_slots,
                    sorted(self.watched.leaving))
        if todo.problem:
            log.error("scale: %s", todo.problem)
        lc = self.cfg.launch
        for i in todo.start:
            tell(log, f"scale: starting producer {i}; it joins the run once its engine is up")
            pg = place(self.ray, f"producer-{i}", [bundle(lc.producer_num_cpus,
                       lc.producer_num_gpus, lc.producer_resources)], lc.producer_strategy,
                       lc.producer_labels, lc.ray_timeout_s)
            self.pgs.append(pg)
            self.producers[i] = actor = self._producer(pg, 0, i, False)
            self.watched.add(i, actor, self.ray.get(actor.info.remote()))
        for i in todo.leave:
            tell(log, f"scale: producer {i} leaves the run once the groups it started are in "
                 "the learner's checkpoint")
            self.watched.leaving.add(i)
            self.producers[i].leave.remote()

    def report_placement(self) -> dict[str, Any]:
        """Log where the learner and each producer run, write run_dir/placement.json, and set up
        the producers' watch and the learner's mirror; returns the learner's endpoints."""
        ray, producers = self.ray, self.producers
        ep = ray.get(self.learner.get_endpoints.remote())
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
            self._name(i).replace(" ", ""): info["node_id"]
            for i, info in zip(producers, infos, strict=True)
        }
        (self.run_dir / "placement.json").write_text(json.dumps(placement, indent=1))
        for i, info in zip(producers, infos, strict=True):
            log.info(
                "ray: %s on node %s (%s), actor pid %d, %s pid %d",
                self._name(i),
                info["node_id"][:12],
                info["ip"],
                info["actor_pid"],
                self._name(i).split()[0],
                info["pid"],
            )
        self.mirror = None if ep["same_dir"] else _Mirror(ray, self.learner, self.run_dir)
        self.watched = ProducerWatch(ray, producers, infos, self.evaluator)
        return ep

    def _name(self, i: int) -> str:
        return "evaluator" if i == self.evaluator else f"producer {i}"

    def watch(self, learner_ep: dict[str, Any], movable: bool) -> int:
        """Until the learner's child exits (``_watch``); ``movable``: Ray may restart the
        learner on another node (its checkpoints are on a shared run_dir)."""
        assert self.watched is not None
        if self.scale is not None:
            record_launcher(self.run_dir)
            log.info("ray: elastic, up to %d producers: pipeline-train scale %s --producers N",
                     self.cfg.producer_slots, self.run_dir)
        return _watch(self.ray, self.learner, self.watched, self.mirror, learner_ep["pid"],
                      learner_ep["node_id"], movable, self.apply_scale)

    def teardown(self) -> None:
        """Stop what was started, producers whose node is gone not waited for."""
        watched = self.watched
        gone = watched.lost | watched.dead if watched is not None else set()
        _teardown(self.ray, self.learner, self.producers, self.pgs, self.run_dir, self.mirror,
                  gone)
        if self.scale is not None:
            (self.run_dir / LAUNCHER_FILE).unlink(missing_ok=True)
        if self.reward_actors:
            from pipeline.producer.rewards.ray_replicas import stop_replicas

            stop_replicas(self.ray, self.reward_actors)
        with contextlib.suppress(Exception):
            self.ray.shutdown()


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


def _watch(
    ray: Any,
    learner: Any,
    producers: ProducerWatch,
    mirror: _Mirror | None,
    learner_pid: int,
    learner_node: str,
    learner_movable: bool,
    tick: Any = None,
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
            if not dead_for_good(ray, learner.poll.remote):
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
        if tick is not None:  # pipeline-train scale requests (elastic runs)
            tick()
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
