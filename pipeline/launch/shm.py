"""Reclaim what killed processes leave in /dev/shm: engine segments and snapshot directories.

vLLM's engine processes talk through POSIX shared memory (``/dev/shm/psm_*``, Python's
``multiprocessing.shared_memory``). A producer killed with SIGKILL takes its engine's process group
with it, so nobody unlinks those segments and they hold host memory until reboot. The launcher
records which segments existed before it started anything, and after a child dies (and at the
end of the run) removes the ones created since that no live process maps or holds open: a
segment whose creator is alive is always mapped by it, so only orphans match.

A launcher killed itself (kill -9) cleans up nothing. So while it runs it keeps a record of the
segments created since it started (``pipeline-grpo-segments.owner-<tag>``), and the learner names
its snapshot directory ``pipeline-grpo-<run>.owner-<tag>``, both with the launcher's owner tag
(pipeline.owner). At start, every launcher reclaims the directories and the recorded segments
whose owner is dead; a recorded segment is still kept while any live process maps or holds it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from pathlib import Path

from pipeline.owner import OWNED, owned_name, owner_alive

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "psm_"
_OWNED_NAME = re.compile(r"pipeline-grpo-.*\.owner-(\d+(?:-\d+)?)")


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
                        used.add(line[i + len(prefix) :].split()[0])
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(prefix):
                        used.add(target[len(prefix) :].split()[0])
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
        log.info("removed %d shared-memory segment(s) left by dead engine processes", len(orphans))
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


def record_segments(
    before: set[str],
    shm_dir: Path = SHM_DIR,
    owner: str | None = None,
    known: set[str] | None = None,
) -> set[str]:
    """Write down the segments created since ``before`` under this owner's tag (atomically),
    for a later run to reclaim should this launcher be killed; returns the set written.
    ``known``: the set written last time; nothing is written if it did not change."""
    created = list_segments(shm_dir) - before
    if known is not None and created == known:
        return known
    path = shm_dir / owned_name("segments", owner)
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_text("".join(f"{n}\n" for n in sorted(created)))
        tmp.replace(path)
    return created


def forget_record(shm_dir: Path = SHM_DIR, owner: str | None = None) -> None:
    """Drop this owner's segment record (at a clean exit, after its own reclaim)."""
    with contextlib.suppress(FileNotFoundError):
        (shm_dir / owned_name("segments", owner)).unlink()


def _size(path: Path) -> int:
    if path.is_dir() and not path.is_symlink():
        total = 0
        for f in path.rglob("*"):
            with contextlib.suppress(OSError):
                if f.is_file() and not f.is_symlink():
                    total += f.stat().st_blocks * 512
        return total
    with contextlib.suppress(OSError):
        return path.stat().st_blocks * 512  # shm segments are sparse: count what they hold
    return 0


def recorded_by_live_owners(shm_dir: Path = SHM_DIR) -> set[str]:
    """Segments in the records of launchers still running: theirs to reclaim (a killed engine's
    until its launcher restarts it or exits), not leaked by anyone else."""
    out: set[str] = set()
    if not shm_dir.is_dir():
        return out
    for p in shm_dir.glob(f"{OWNED}segments.owner-*"):
        m = _OWNED_NAME.fullmatch(p.name)
        with contextlib.suppress(OSError):
            if m and owner_alive(m.group(1)):
                out |= {n for n in p.read_text().split() if n.startswith(PREFIX)}
    return out


def dead_owned(shm_dir: Path = SHM_DIR) -> list[Path]:
    """This user's owned entries (snapshot dirs, segment records) whose owner is dead."""
    if not shm_dir.is_dir():
        return []
    uid = os.getuid()
    dead: list[Path] = []
    for p in shm_dir.glob(f"{OWNED}*"):
        m = _OWNED_NAME.fullmatch(p.name)
        with contextlib.suppress(OSError):
            if m and p.lstat().st_uid == uid and not owner_alive(m.group(1)):
                dead.append(p)
    return dead


def reclaim_dead_owners(shm_dir: Path = SHM_DIR) -> tuple[int, int]:
    """Remove this user's snapshot directories and recorded engine segments whose owner
    process is dead, except segments a live process still maps or holds open: a record keeps
    those (an engine core may outlive its owner by seconds), so a later call frees them. Logs
    one line when anything was freed; returns (entries removed, bytes freed)."""
    dead = dead_owned(shm_dir)
    if not dead:
        return 0, 0
    records = [p for p in dead if p.is_file()]
    recorded: dict[Path, set[str]] = {}
    for r in records:
        with contextlib.suppress(OSError):
            recorded[r] = {n for n in r.read_text().split() if n.startswith(PREFIX)}
    existing = list_segments(shm_dir) if recorded else set()
    in_use = segments_in_use(shm_dir) if recorded else set()
    segments = sorted((set().union(*recorded.values()) & existing) - in_use) if recorded else []
    freed = removed_dirs = 0
    for d in (p for p in dead if p.is_dir() and not p.is_symlink()):
        freed += _size(d)
        shutil.rmtree(d, ignore_errors=True)
        removed_dirs += 1
    for name in segments:
        seg = shm_dir / name
        size = _size(seg)
        with contextlib.suppress(FileNotFoundError):
            seg.unlink()
            freed += size
    for r in records:
        kept = recorded.get(r, set()) & existing & in_use
        with contextlib.suppress(OSError):
            if kept:
                r.write_text("".join(f"{n}\n" for n in sorted(kept)))
            else:
                r.unlink()
    if removed_dirs or segments:
        log.warning(
            "reclaimed %.1f MB in %s left by killed runs: %d snapshot dir(s), %d engine segment(s)",
            freed / 1e6,
            shm_dir,
            removed_dirs,
            len(segments),
        )
    return removed_dirs + len(segments), freed
