"""Experiment trackers named in ``report_to`` (TRL's convention): wandb, trackio and mlflow.

TensorBoard, the default, is written by ``metrics.MetricsLogger`` itself; this module owns the
optional ones. Each tracker's package is imported only when the tracker is named, so a run
that names none needs none of them installed. Every tracker gets the run name, the full
config, and every numeric scalar of every step, with the learner step as its step.

Invariants: a tracker never stops training. One that fails to start, or fails while logging,
is switched off with one warning; ``run_dir/metrics.jsonl`` always holds every number.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pipeline.config import TRACKERS

log = logging.getLogger(__name__)

PACKAGES = {name: name for name in TRACKERS}
"""Import name of each tracker's package (``pip install -e .[trackers]``)."""

DEFAULT_PROJECT = "pipeline-grpo"


def missing_packages(report_to: list[str]) -> list[str]:
    """Trackers named in ``report_to`` whose package cannot be imported here (checked without
    importing it)."""
    return [name for name in report_to if importlib.util.find_spec(PACKAGES[name]) is None]


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as ``section.key -> value`` (lists and dicts below the leaves kept)."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, Mapping) and v and k != "extra":
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def numeric(values: Mapping[str, Any]) -> dict[str, float]:
    """The finite numeric scalars of a metrics record (booleans and text left out)."""
    return {
        k: float(v)
        for k, v in values.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


class _Wandb:
    name = "wandb"

    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any]) -> None:
        import wandb

        # WANDB_PROJECT, WANDB_MODE (offline), WANDB_DIR ... are honoured as wandb documents.
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT),
            name=run_name,
            config=config,
            dir=os.environ.get("WANDB_DIR", str(run_dir)),
            reinit=True,
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class _Trackio:
    name = "trackio"

    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any]) -> None:
        import trackio

        # Local-first: it stores under TRACKIO_DIR (or its own default) unless a Space is set.
        # Its banner goes to the log, not the console; system metrics are not asked for.
        with _stdout_to_log("trackio"):
            self.run = trackio.init(
                project=os.environ.get("TRACKIO_PROJECT", DEFAULT_PROJECT),
                name=run_name,
                config=config,
                embed=False,
                auto_log_gpu=False,
                auto_log_cpu=False,
            )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        with _stdout_to_log("trackio"):
            self.run.finish()
        # trackio finishes its current run again at exit (printing to the console) unless it is
        # cleared, as trackio.finish() does for the run it holds.
        with contextlib.suppress(Exception):
            from trackio import context_vars

            if context_vars.current_run.get() is self.run:
                context_vars.current_run.set(None)


class _Mlflow:
    name = "mlflow"

    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any]) -> None:
        import mlflow

        self.mlflow = mlflow
        # MLFLOW_TRACKING_URI wins; otherwise a file store inside the run directory, so a run
        # needs no server and its numbers stay next to metrics.jsonl.
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        self.file_store = uri.startswith("file:") or "://" not in uri
        if self.file_store:
            # MLflow 3 refuses its file store unless told that it is wanted.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        exp_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_PROJECT)
        exp = self.client.get_experiment_by_name(exp_name)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(exp_name)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        flat = flat_config(config)
        params = [mlflow.entities.Param(k, str(v)[:500]) for k, v in sorted(flat.items())]
        for i in range(0, len(params), 100):  # the tracking API's batch limit
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.client.log_dict(self.run_id, config, "config.json")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        ts = int(time.time() * 1000)
        metrics = [self.mlflow.entities.Metric(self.key(k), v, ts, step)
                   for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def key(self, name: str) -> str:
        """The file store keeps a metric as a file named by its path, so ``reward/x`` and
        ``reward/x/failures`` cannot both exist there: it gets ``reward.x``, ``reward.x.failures``
        (a tracking server keeps the names as they are)."""
        return name.replace("/", ".") if self.file_store else name

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


@contextlib.contextmanager
def _stdout_to_log(name: str) -> Iterator[None]:
    """What a tracker prints while starting or finishing goes to the log at info level."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            yield
    finally:
        for line in buf.getvalue().splitlines():
            if line.strip():
                log.info("%s: %s", name, line.strip())


_OPENERS = {"wandb": _Wandb, "trackio": _Trackio, "mlflow": _Mlflow}


class Trackers:
    """The optional trackers of a run (TensorBoard excluded: MetricsLogger writes it)."""

    def __init__(
        self, report_to: list[str], run_dir: Path, run_name: str, config: dict[str, Any]
    ) -> None:
        self.active: list[Any] = []
        for name in report_to:
            if name not in _OPENERS:
                continue
            try:
                self.active.append(_OPENERS[name](Path(run_dir), run_name, config))
            except Exception as e:  # a tracker never stops training
                log.warning(
                    "report_to: %s could not start (%s: %s); its numbers stay in metrics.jsonl",
                    name,
                    type(e).__name__,
                    e,
                )

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.active]

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        scalars = numeric(values)
        for t in list(self.active):
            try:
                t.log(step, scalars)
            except Exception as e:
                log.warning(
                    "report_to: %s failed while logging step %d (%s: %s); switched off",
                    t.name,
                    step,
                    type(e).__name__,
                    e,
                )
                self.active.remove(t)
                self._close(t)

    def close(self) -> None:
        while self.active:
            self._close(self.active.pop())

    @staticmethod
    def _close(t: Any) -> None:
        try:
            t.close()
        except Exception as e:
            log.warning("report_to: %s failed to close (%s: %s)", t.name, type(e).__name__, e)
