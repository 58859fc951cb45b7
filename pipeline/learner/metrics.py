"""Training metrics: one JSONL file per run, TensorBoard scalars, the optional trackers of
``report_to`` (``trackers``), a progress line, and a plot.

This module owns how a run's per-step numbers leave the learner. ``run_dir/metrics.jsonl`` is the
source of truth: one JSON object per learner step, ``{"step", "time", "ts", **metrics}``, written
in append mode and flushed line by line so that a crash loses at most the line being written and a
resumed run continues the same file. TensorBoard is a best-effort mirror (skipped with one warning
when it cannot be imported); the progress line is for humans and CI logs.

Invariants:
- ``time`` is training wall-clock seconds and keeps increasing across resumes: a resumed logger
  starts from the last ``time`` already in the file, so the gap while the run was down is not
  counted.
- Heavy imports (TensorBoard, matplotlib) happen only when used; no pyplot state is touched
  (plots draw on a private ``Figure`` with the Agg canvas).

CLI: ``python -m pipeline.learner.metrics plot RUN_DIR [--out PNG]`` writes ``RUN_DIR/reward.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from pipeline.appendfile import AppendFile

__all__ = [
    "METRICS_FILE",
    "MetricsLogger",
    "carry_counters",
    "format_progress",
    "main",
    "plot_run",
    "producer_metrics",
    "read_metrics",
]

METRICS_FILE = "metrics.jsonl"
"""Name of the per-run metrics file inside the run directory."""

_RESERVED = ("step", "time", "ts")
_STALENESS_HIST_PREFIX = "staleness_hist/"


def _scalar(value: Any) -> Any:
    """Python scalar for JSON: unwraps numpy and 0-d torch values (``.item()``)."""
    item = getattr(value, "item", None)
    return item() if callable(item) else value


def read_metrics(path: Path) -> list[dict]:
    """All records of a metrics JSONL file, in order.

    A malformed line (typically the last one, cut short by a crash) is skipped with a warning.
    """
    records: list[dict] = []
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                warnings.warn(f"{path}:{lineno}: skipping malformed metrics line", stacklevel=2)
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


class MetricsLogger:
    """Writes one record per step to JSONL, TensorBoard and a progress line.

    Usable as a context manager; ``close()`` is idempotent.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        tensorboard: bool = True,
        progress: bool = True,
        total_steps: int | None = None,
        stream: TextIO | None = None,
        trackers: Any = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.total_steps = total_steps
        self._progress = progress
        # Resolved at call time, not at import, so redirected stderr (pytest, daemons) is honoured.
        self._stream = stream if stream is not None else sys.stderr
        self._tensorboard = tensorboard
        # Optional experiment trackers (``trackers.Trackers``): log(step, values), close().
        self._trackers = trackers
        self._writer: Any = None
        self._tb_failed = False

        self._time_offset = 0.0
        self.first_reward: float | None = None
        if self.path.exists() and self.path.stat().st_size > 0:
            previous = read_metrics(self.path)
            if previous:
                self._time_offset = float(previous[-1].get("time", 0.0))
            self.first_reward = next(
                (float(r["reward_mean"]) for r in previous if "reward_mean" in r), None
            )
            with self.path.open("rb") as f:
                f.seek(-1, 2)
                torn = f.read(1) != b"\n"
        else:
            torn = False
        # Whole rows only; a row the disk has no room for waits, in order, for the next
        # (``pipeline.appendfile``): a full run_dir delays rows, never loses or tears them.
        self._file: AppendFile | None = AppendFile(self.path)
        if torn:
            # A crash mid-write left a partial line; start on a fresh one so it stays isolated.
            self._file.append(b"\n")
        self._start = time.monotonic()

    def log(self, step: int, metrics: Mapping[str, float | int], progress: bool = True) -> None:
        """Record ``metrics`` for learner ``step`` (the number of completed steps); ``progress``
        False: no progress line for this row (a row that is not a training step's)."""
        if self._file is None:
            raise RuntimeError("MetricsLogger is closed")
        clash = [k for k in _RESERVED if k in metrics]
        if clash:
            raise ValueError(f"metric names {clash} are reserved")
        values = {k: _scalar(v) for k, v in metrics.items()}
        record = {
            "step": int(step),
            "time": round(self._time_offset + time.monotonic() - self._start, 3),
            "ts": round(time.time(), 3),
            **values,
        }
        self._file.append((json.dumps(record) + "\n").encode())

        if self.first_reward is None and "reward_mean" in values:
            self.first_reward = float(values["reward_mean"])
        if self._tensorboard:
            self._write_tensorboard(int(step), values)
        if self._trackers is not None:
            self._trackers.log(int(step), values)
        if self._progress and progress:
            line = format_progress(step, self.total_steps, record, first_reward=self.first_reward)
            print(line, file=self._stream, flush=True)

    def _write_tensorboard(self, step: int, values: Mapping[str, Any]) -> None:
        if self._writer is None and not self._tb_failed:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except Exception as e:  # ImportError, or tensorboard's own import-time failures
                self._tb_failed = True
                warnings.warn(
                    f"TensorBoard logging disabled ({type(e).__name__}: {e}); "
                    f"metrics still go to {self.path}",
                    stacklevel=3,
                )
                return
            self._writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), flush_secs=10)
        if self._writer is None:
            return
        for key, value in values.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self._file is not None:
            if not self._file.retry():
                warnings.warn(f"{len(self._file.waiting)} metrics row(s) not written to "
                              f"{self.path}: its disk is full", RuntimeWarning, stacklevel=2)
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._trackers is not None:
            self._trackers.close()
            self._trackers = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def carry_counters(carried: Mapping[str, float], last: Mapping[str, float]) -> dict[str, float]:
    """A restarted producer's counters start again from zero: what its earlier processes
    counted (``carried``, plus their ``last`` heartbeat) is added to the new process's
    counters. Rates (names ending in ``_per_s``) are not carried over."""
    out = dict(carried)
    for key, value in last.items():
        if not key.endswith("_per_s"):
            out[key] = out.get(key, 0.0) + float(value)
    return out


def producer_metrics(per_producer: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """The producers' heartbeat counters as metrics: each producer's under
    ``by_producer/<id>/<name>``, and their sum over producers under ``reward/<name>/<kind>``
    for the reward counters (the names the rewards count them under) and ``producer/<name>``
    for the rest (rates too: the producers' rates add up when they generate side by side)."""
    out: dict[str, float] = {}
    for pid in sorted(per_producer):
        for key, value in per_producer[pid].items():
            out[f"by_producer/{pid}/{key}"] = float(value)
            total = key if key.startswith("reward/") else f"producer/{key}"
            out[total] = out.get(total, 0.0) + float(value)
    return out


def _fmt_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{s:02d}s"
    return f"{s}s"


def _fmt_count(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.1f}{suffix}"
    return f"{x:.0f}"


def format_progress(
    step: int,
    total_steps: int | None,
    metrics: Mapping[str, Any],
    *,
    first_reward: float | None = None,
) -> str:
    """One human-readable progress line.

    Example: ``step 12/40 | reward 0.41 (first 0.12) | 1.8k tok/s | learner 20k tok/s 41% MFU |
    stale 0.6 | buffer 5 | sync 0.42s | 3m10s elapsed, ~4m40s left``. Each part appears only
    when its key is present (``reward_mean``, ``tokens_per_s``, ``learner_tokens_per_s`` and
    ``mfu``, ``staleness_mean``, ``buffer_size``, ``sync_s``, ``time`` for elapsed seconds);
    the estimate of time left needs ``total_steps`` and ``step > 0``.
    """
    parts = [f"step {step}/{total_steps}" if total_steps else f"step {step}"]
    if "reward_mean" in metrics:
        reward = f"reward {float(metrics['reward_mean']):.2f}"
        if first_reward is not None:
            reward += f" (first {first_reward:.2f})"
        parts.append(reward)
    if "tokens_per_s" in metrics:
        parts.append(f"{_fmt_count(float(metrics['tokens_per_s']))} tok/s")
    if "learner_tokens_per_s" in metrics:
        learner = f"learner {_fmt_count(float(metrics['learner_tokens_per_s']))} tok/s"
        if "mfu" in metrics:
            learner += f" {float(metrics['mfu']):.0%} MFU"
        parts.append(learner)
    if "staleness_mean" in metrics:
        parts.append(f"stale {float(metrics['staleness_mean']):.1f}")
    if "buffer_size" in metrics:
        parts.append(f"buffer {int(metrics['buffer_size'])}")
    if "sync_s" in metrics:
        parts.append(f"sync {float(metrics['sync_s']):.2f}s")
    if "time" in metrics:
        elapsed = float(metrics["time"])
        timing = f"{_fmt_duration(elapsed)} elapsed"
        if total_steps and step > 0:
            left = elapsed / step * max(0, total_steps - step)
            timing += f", ~{_fmt_duration(left)} left"
        parts.append(timing)
    return " | ".join(parts)


def _rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` points (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_run(metrics_path: Path, out_png: Path) -> Path:
    """Plot reward vs training minutes and the staleness histogram of a run; returns ``out_png``.

    Staleness comes from the accumulated ``staleness_hist/<k>`` counts when logged, else from a
    histogram of the per-step ``staleness_mean``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metrics_path, out_png = Path(metrics_path), Path(out_png)
    records = read_metrics(metrics_path)
    run_name = metrics_path.parent.name or str(metrics_path)

    fig = Figure(figsize=(11, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax_r, ax_s = fig.subplots(1, 2)
    _plot_rewards(ax_r, records)
    _plot_staleness(ax_s, records)

    fig.suptitle(f"{run_name} ({len(records)} steps)")
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


def _plot_rewards(ax_r: Any, records: list[dict]) -> None:
    """``reward_mean`` per step against wall-clock minutes, with its rolling mean."""
    rewarded = [
        r
        for r in records
        if isinstance(r.get("reward_mean"), int | float) and math.isfinite(r["reward_mean"])
    ]
    if rewarded:
        minutes = [float(r.get("time", r.get("step", i))) / 60 for i, r in enumerate(rewarded)]
        rewards = [float(r["reward_mean"]) for r in rewarded]
        window = max(1, min(20, len(rewards) // 5))
        ax_r.plot(
            minutes,
            rewards,
            marker="o" if len(rewards) < 30 else None,
            ms=3,
            alpha=0.4,
            label="reward_mean",
        )
        ax_r.plot(minutes, _rolling_mean(rewards, window), lw=2, label=f"rolling mean ({window})")
        ax_r.legend(loc="best")
    else:
        ax_r.text(
            0.5, 0.5, "no reward_mean logged", ha="center", va="center", transform=ax_r.transAxes
        )
    ax_r.set_xlabel("wall-clock (min)")
    ax_r.set_ylabel("reward")
    ax_r.set_title("reward")
    ax_r.grid(alpha=0.3)


def _staleness_counts(records: list[dict]) -> dict[int, float]:
    """Groups per staleness, summed over the run's ``staleness_hist/<k>`` counts."""
    hist: dict[int, float] = {}
    for r in records:
        for key, value in r.items():
            if key.startswith(_STALENESS_HIST_PREFIX) and isinstance(value, int | float):
                try:
                    k = int(key[len(_STALENESS_HIST_PREFIX) :])
                except ValueError:
                    continue
                hist[k] = hist.get(k, 0.0) + float(value)
    return hist


def _plot_staleness(ax_s: Any, records: list[dict]) -> None:
    """The staleness histogram: groups per staleness, else the per-step means."""
    hist = _staleness_counts(records)
    means = [
        float(r["staleness_mean"])
        for r in records
        if isinstance(r.get("staleness_mean"), int | float)
    ]
    if hist:
        ks = sorted(hist)
        ax_s.bar(ks, [hist[k] for k in ks], width=0.8)
        ax_s.set_xticks(ks)
        ax_s.set_xlabel("staleness (learner version − policy_version)")
        ax_s.set_ylabel("groups")
    elif means:
        ax_s.hist(means, bins=min(20, max(1, len(set(means)))))
        ax_s.set_xlabel("mean staleness per step")
        ax_s.set_ylabel("steps")
    else:
        ax_s.text(
            0.5, 0.5, "no staleness logged", ha="center", va="center", transform=ax_s.transAxes
        )
    ax_s.set_title("staleness")
    ax_s.grid(alpha=0.3)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.learner.metrics", description="Run metrics tools."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    plot = sub.add_parser("plot", help="plot reward and staleness of a run to a PNG")
    plot.add_argument("run_dir", type=Path, help=f"run directory holding {METRICS_FILE}")
    plot.add_argument(
        "--out", type=Path, default=None, help="output PNG (default RUN_DIR/reward.png)"
    )
    args = parser.parse_args(argv)

    metrics_path = args.run_dir / METRICS_FILE
    if not metrics_path.is_file():
        print(f"error: {metrics_path} not found", file=sys.stderr)
        return 2
    out = plot_run(metrics_path, args.out or args.run_dir / "reward.png")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
