"""Reclaim shared-memory segments that a killed vLLM engine leaves in /dev/shm.

vLLM's engine processes talk through POSIX shared memory (``/dev/shm/psm_*``, Python's
``multiprocessing.shared_memory``). A producer killed with SIGKILL takes its engine's process group
with it, so nobody unlinks those segments and they hold host memory until reboot. The launcher
records which segments existed before it started anything, and after a child dies (and at the
end of the run) removes the ones created since that no live process maps or holds open: a
segment whose creator is alive is always mapped by it, so only orphans match.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "psm_"


def list_segments(shm_dir: Path = SHM_DIR) -> set[str]:
    """Names of this user's vLLM/multiprocessing segments."""
    if not shm_dir.is_dir():
        return set()
    uid = os.getuid()
    out = set()
    for p in shm_dir.glob(f"{PREFIX}*"):
        with contextlib.suppress(OSError):
            if p.stat().st_uid == uid:
                out.add(p.name)
    return out


def segments_in_use(shm_dir: Path = SHM_DIR) -> set[str]:
    """Segment names mapped (``/proc/*/maps``) or open (``/proc/*/fd``) by any visible process."""
    prefix = f"{shm_dir}/"
    used: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as fh:
                for line in fh:
                    i = line.find(prefix)
                    if i >= 0:
                        used.add(line[i + len(prefix):].split()[0])
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(prefix):
                        used.add(target[len(prefix):].split()[0])
    return used


def reclaim_orphans(before: set[str], shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink segments created since ``before`` that no live process uses; returns their names."""
    new = list_segments(shm_dir) - before
    if not new:
        return []
    orphans = sorted(new - segments_in_use(shm_dir))
    for name in orphans:
        with contextlib.suppress(FileNotFoundError):
            (shm_dir / name).unlink()
    if orphans:
        log.info("removed %d shared-memory segment(s) left by dead engine processes",
                 len(orphans))
    return orphans


def forget_tracked(names: list[str]) -> None:
    """Tell this process's multiprocessing resource tracker that ``names`` are gone.

    Every process the launcher spawns (producers, their vLLM engine cores) shares the launcher's
    tracker, which records each segment they create. For a segment that reclaim_orphans removed,
    the tracker would otherwise try to unlink it again when the launcher exits and print two
    alarming "leaked shared_memory" / "No such file" warnings. Registering first makes the
    unregister safe for a name the tracker never saw (it raises on unknown names).
    """
    from multiprocessing import resource_tracker

    for name in names:
        resource_tracker.register(f"/{name}", "shared_memory")
        resource_tracker.unregister(f"/{name}", "shared_memory")
