"""A run directory before and after a run: an earlier run set aside so a fresh one never appends
to it, and the end-of-run line about groups still waiting in the producers' outboxes."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pipeline.learner.disk import step_dirs

log = logging.getLogger("pipeline")


def set_aside_previous_run(run_dir: Path) -> Path | None:
    """A fresh run (no --resume) in a run_dir that holds an earlier run's metrics or
    checkpoints renames that run_dir to ``<run_dir>.prev-<time>`` first: appending to its
    metrics would mix two runs in one curve, and ``--resume`` would later pick its checkpoints.
    Nothing is deleted. An empty ``checkpoints`` directory is no earlier run: it may be where
    the user mounted the disk for this run's checkpoints."""
    ckpts = run_dir / "checkpoints"
    held = bool(step_dirs(ckpts)) or (ckpts / "LATEST").exists()
    if not ((run_dir / "metrics.jsonl").exists() or held):
        return None
    dest = run_dir.with_name(f"{run_dir.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while dest.exists():
        dest = dest.with_name(f"{dest.name.split('~')[0]}~{n}")
        n += 1
    run_dir.rename(dest)
    log.warning("%s held an earlier run; moved it to %s (use --resume to continue a run)",
                run_dir, dest)
    return dest


def roster_for_launch(run_dir: Path, resume: bool, num_producers: int) -> None:
    """The learner's roster (``pipeline.learner.roster``) as a launch starts: a fresh run has
    none (an earlier one's, from a run stopped before any metrics, would lease it nothing and
    name its producers); ``--resume`` keeps its leases but starts with the producers this launch
    starts. A learner the launcher restarts later keeps it as it is."""
    from pipeline.learner.roster import ROSTER_FILE, relaunch

    if resume:
        relaunch(run_dir, num_producers)
    else:
        (run_dir / ROSTER_FILE).unlink(missing_ok=True)


def waiting_groups_line(run_dir: Path, max_staleness: int) -> str | None:
    """One line for the end of a run when producers' outboxes (``run_dir/producers/*.wal``)
    hold groups that the learner's last checkpoint lacks: generated but never delivered (a
    producer restarted late, whose successor was still starting its engine when the learner
    finished; groups in flight at the end). ``--resume`` resends them; None when there are none.
    """
    import json

    from buffer.ledger import GroupLedger
    from buffer.staleness import is_trainable
    from pipeline.learner.checkpoint import latest_checkpoint
    from pipeline.producer.outbox import undelivered

    ckpt = latest_checkpoint(run_dir)
    state = json.loads((ckpt / "state.json").read_text()) if ckpt is not None else {}
    waiting = undelivered(run_dir / "producers", GroupLedger.from_dict(state.get("ledger") or {}))
    if not waiting:
        return None
    version = int(state.get("version", 0))
    total = sum(len(v) for v in waiting.values())
    fresh = sum(is_trainable(v, version, max_staleness) for vs in waiting.values() for v in vs)
    where = ", ".join(f"{name}: {len(vs)}" for name, vs in waiting.items())
    stale = (f" (the other {total - fresh}: dropped, older than train.max_staleness allows)"
             if fresh < total else "")
    return (f"pipeline-train: {total} group(s) generated but not delivered wait in "
            f"{run_dir / 'producers'}/ ({where}); --resume with a larger --steps trains "
            f"{'them' if fresh == total else f'{fresh} of them'}{stale}")
