"""Who owns a run's shared-memory leftovers: an owner tag recorded in their names.

A run's /dev/shm snapshot directory and its record of engine segments carry the tag of the
process that owns them: the launcher (every child inherits its tag through ``OWNER_ENV``), or the
process itself when no launcher set one. A tag is ``<pid>-<start time>`` (the kernel's start time
of that pid, in clock ticks since boot), so a pid reused by an unrelated process does not keep a
dead run's leftovers alive. Anything whose owner is gone may be reclaimed by a later run
(pipeline.launch.shm); anything whose owner lives is never touched.
"""

from __future__ import annotations

import contextlib
import os
import re

OWNER_ENV = "PIPELINE_GRPO_OWNER"
OWNED = "pipeline-grpo-"  # the prefix of every /dev/shm name that carries an owner tag
_TAG = re.compile(r"(\d+)(?:-(\d+))?")


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on; None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return stat[stat.rfind(")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (/proc/<pid>/stat field 22), None if unknown."""
    fields = _stat(pid)
    with contextlib.suppress(TypeError, IndexError, ValueError):
        return int(fields[19])
    return None


def owner_tag(pid: int | None = None) -> str:
    """The tag of ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    start = start_time(pid)
    return f"{pid}-{start}" if start is not None else str(pid)


def current_owner() -> str:
    """The tag this process records on what it leaves in shared memory: its launcher's if it
    was started by one, else its own."""
    tag = os.environ.get(OWNER_ENV, "")
    return tag if _TAG.fullmatch(tag) else owner_tag()


def owner_alive(tag: str) -> bool:
    """Whether the process ``tag`` names still runs (the same process: same pid, same start
    time). An unparseable tag counts as alive: never reclaim what cannot be placed."""
    m = _TAG.fullmatch(tag)
    if m is None:
        return True
    pid = int(m.group(1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process holds this pid: alive (and not the owner, see below)
    fields = _stat(pid)
    if fields and fields[0] in ("Z", "X"):
        return False  # a zombie: dead, only not yet reaped by its parent
    if m.group(2) is None or not fields:
        return True
    start = start_time(pid)
    return start is None or start == int(m.group(2))


def owned_name(stem: str, owner: str | None = None) -> str:
    """``pipeline-grpo-<stem>.owner-<tag>``: a /dev/shm name a later run can place."""
    return f"{OWNED}{stem}.owner-{owner or current_owner()}"
