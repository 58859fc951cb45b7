"""What the Ray launcher's end-to-end tests share: the command line of a run on a loopback cluster,
the cluster settings that make a lost node seen in seconds, the driver's placement lines, and the
checks after a run (its console kept for a post-mortem, nothing of it left behind)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import assert_no_process_left

from tests.e2e.support.launcher import REPO, Launcher, assert_gone, leaked_segments

# The head's GCS health-checks every raylet each second and gives up after 3 failures.
HEALTH_CHECK = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}
# Ray's memory monitor kills workers when the whole machine (shared with other jobs) is nearly
# full; the kernel's OOM killer still applies.
NO_MEMORY_MONITOR = {"RAY_memory_monitor_refresh_ms": "0"}

PLACED = r"ray: producer (\d) on node \w+ \(([\d.]+)\), actor pid (\d+), producer pid (\d+)"
LEARNER = r"ray: learner on node \w+ \([\d.]+\), actor pid (\d+), learner pid (\d+)"


def ray_args(cluster: dict[str, Any] | None, *extra: str) -> tuple[str, ...]:
    """`--launcher ray` on ``cluster`` (loopback_cluster's nodes, head 127.0.0.2): the learner
    on the `learner_node` resource, each producer on its own `producer_node`; with no cluster,
    the run's private node. ``extra`` follows."""
    if cluster is None:
        return ("--launcher", "ray", *extra)
    return (
        "--launcher",
        "ray",
        "--ray-address",
        cluster["127.0.0.2"].address,
        "--set",
        "launch.learner_resources={learner_node: 1}",
        "--set",
        "launch.producer_resources={producer_node: 1}",
        "--set",
        "launch.producer_strategy=STRICT_SPREAD",
        *extra,
    )


def stop_and_keep_log(la: Launcher, path: Path) -> str:
    """Stop the launcher if it still runs and keep its console in ``path`` (a failure's
    post-mortem); returns that console."""
    la.stop()
    log = "\n".join(la.lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(log)
    return log


def assert_run_clean(la: Launcher, tag: str, shm_before: set[str], log: str) -> None:
    """Nothing of the run is left: no traceback from the repository's code on the console, no
    process the driver started or that carries the run's tag, no new shared-memory segment."""
    assert f'File "{REPO}/' not in log, log[-3000:]
    assert_gone(la.descendants, "driver children")
    assert_no_process_left(tag)
    assert leaked_segments(shm_before) == set()
