"""Experiment trackers of ``report_to``: the real wandb (offline), mlflow (file store) and trackio
(local SQLite) packages receive the run name, the config and every scalar of every step, through
the learner's MetricsLogger. Each test skips, with the reason, where its package is absent."""

from __future__ import annotations

import glob
import json
import logging
import struct
import time

import pytest

from pipeline.config import load_config
from pipeline.launch import preflight
from pipeline.learner import trackers as trackers_mod
from pipeline.learner.metrics import MetricsLogger
from pipeline.learner.trackers import Trackers, flat_config, missing_packages, numeric
from pipeline.options import ConfigError, to_dict

STEPS = [
    {"reward_mean": 0.25, "reward/accuracy": 0.5, "loss": -0.125, "staleness_hist/0": 4.0,
     "reward/accuracy/failures": 1.0},  # a name that is also the folder of another
    {"reward_mean": 0.5, "reward/accuracy": 0.75, "loss": -0.25, "staleness_hist/0": 4.0},
    {"reward_mean": 0.75, "reward/accuracy": 1.0, "loss": -0.5, "staleness_hist/1": 4.0},
]


def _log_run(tmp_path, report_to, name="trk-run"):
    cfg = load_config(
        None,
        {"name": name, "run_dir": str(tmp_path / "run"), "report_to": report_to, "train.lr": 3e-6},
    )
    trk = Trackers(cfg.report_to, tmp_path / "run", cfg.name, to_dict(cfg))
    assert trk.names == [t for t in report_to if t != "tensorboard"]
    with MetricsLogger(tmp_path / "run", tensorboard=False, progress=False, trackers=trk) as m:
        for step, values in enumerate(STEPS, start=1):
            m.log(step, {**values, "not_a_number": "x"})
    return cfg


# ----------------------------------------------------------------------------- config


def test_report_to_config():
    assert load_config().report_to == ["tensorboard"]
    cfg = load_config(None, {"report_to": ["wandb", "mlflow", "wandb"]})
    assert cfg.report_to == ["wandb", "mlflow"]
    assert load_config(None, {"report_to": "none"}).report_to == []
    assert load_config(None, {"report_to": "all"}).report_to == list(trackers_mod.TRACKERS)
    assert load_config(None, {"report_to": "tensorboard,trackio"}).report_to == [
        "tensorboard",
        "trackio",
    ]
    assert load_config(None, {"tensorboard": False}).report_to == []
    with pytest.raises(ConfigError, match=r"^report_to: must be a list of tensorboard, wandb"):
        load_config(None, {"report_to": ["comet"]})


def test_cli_report_to():
    from pipeline.launch.cli import parse

    cfg, _ = parse(["--report_to", "[wandb, mlflow]"])
    assert cfg.report_to == ["wandb", "mlflow"]
    cfg, _ = parse(["--report_to", "trackio"])
    assert cfg.report_to == ["trackio"]


def test_helpers():
    assert numeric({"a": 1, "b": 2.5, "c": True, "d": "x", "e": float("nan")}) == {
        "a": 1.0,
        "b": 2.5,
    }
    assert flat_config(
        {
            "train": {"lr": 1e-5, "loss": {"kl_coef": 0.0}},
            "name": "r",
            "engine": {"extra": {"swap_space": 1}},
        }
    ) == {
        "train.lr": 1e-5,
        "train.loss.kl_coef": 0.0,
        "name": "r",
        "engine.extra": {"swap_space": 1},
    }
    assert missing_packages(["tensorboard"]) == []


def test_missing_package_is_one_config_error(monkeypatch):
    """Mocked package lookup (pure logic): a named but absent tracker fails the launcher's
    pre-flight in one line, before any process starts."""
    monkeypatch.setattr(
        trackers_mod.importlib.util, "find_spec", lambda name: None if name == "wandb" else object()
    )
    assert missing_packages(["tensorboard", "wandb", "mlflow"]) == ["wandb"]
    monkeypatch.setattr(trackers_mod, "missing_packages", lambda names: ["wandb"])
    with pytest.raises(ConfigError, match=r"^report_to: wandb named but not installed"):
        preflight.check_trackers(["tensorboard", "wandb"])


class _FakeTracker:
    """A stand-in tracker (mock, for the isolation logic only)."""

    name = "wandb"

    def __init__(self, *a):
        self.logged = []

    def log(self, step, scalars):
        if step == 2:
            raise RuntimeError("connection reset")
        self.logged.append(step)

    def close(self):
        pass


def test_a_failing_tracker_never_stops_training(tmp_path, monkeypatch, caplog):
    def broken(*a):
        raise RuntimeError("no API key")

    monkeypatch.setitem(trackers_mod._OPENERS, "mlflow", broken)
    monkeypatch.setitem(trackers_mod._OPENERS, "wandb", _FakeTracker)
    with caplog.at_level(logging.WARNING):
        trk = Trackers(["mlflow", "wandb"], tmp_path, "r", {})
        assert trk.names == ["wandb"]
        fake = trk.active[0]
        for step in (1, 2, 3):
            trk.log(step, {"x": 1.0})
    assert fake.logged == [1] and trk.names == []
    msgs = [r.getMessage() for r in caplog.records]
    assert any("mlflow could not start" in m and "no API key" in m for m in msgs)
    assert any("wandb failed while logging step 2" in m for m in msgs)


# ---------------------------------------------------------------------- real trackers


def _wandb_records(path):
    """Records of a wandb offline ``.wandb`` file (LevelDB-log framing of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as fh:
        data = fh.read()
    pos, block, buf = 7, 32768, b""  # header: ":W&B" ident (4), magic (2), version (1)
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL/FIRST start a record
        if kind in (1, 4):  # FULL/LAST end it
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec


def test_wandb_offline_scalars_land(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb not installed (pip install -e .[trackers])")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    _log_run(tmp_path, ["wandb"])
    (path,) = glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "run-*.wandb"))
    # wandb's core process may still be flushing the file when finish() returns.
    deadline = time.monotonic() + 60
    while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(path)):
        assert time.monotonic() < deadline, "wandb never wrote its exit record"
        time.sleep(0.2)
    history, run = [], None
    for rec in _wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {i.key or ".".join(i.nested_key): i.value_json for i in rec.history.item}
            )
        elif kind == "run":
            run = rec.run
    assert run is not None and run.display_name == "trk-run"
    config = {c.key: c.value_json for c in run.config.update}
    assert json.loads(config["train"])["lr"] == 3e-6 and json.loads(config["name"]) == "trk-run"
    assert [int(h["_step"]) for h in history] == [1, 2, 3]
    for h, want in zip(history, STEPS, strict=True):
        got = {k: float(v) for k, v in h.items() if not k.startswith("_")}
        assert got == want


def test_mlflow_file_store_scalars_land(tmp_path, monkeypatch):
    mlflow = pytest.importorskip(
        "mlflow", reason="mlflow not installed (pip install -e .[trackers])"
    )
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    _log_run(tmp_path, ["tensorboard", "mlflow"])
    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "run" / "mlruns").as_uri())
    exp = client.get_experiment_by_name("pipeline-grpo")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "trk-run" and run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == "3e-06" and run.data.params["name"] == "trk-run"
    for key in {k for s in STEPS for k in s}:
        # The file store's names: "/" -> "." (reward/accuracy is also a folder there)
        mkey = key.replace("/", ".")
        hist = {m.step: m.value for m in client.get_metric_history(run.info.run_id, mkey)}
        assert hist == {i: s[key] for i, s in enumerate(STEPS, 1) if key in s}, key
    assert "not_a_number" not in run.data.metrics
    art = tmp_path / "run" / "mlruns" / exp.experiment_id / run.info.run_id / "artifacts"
    assert (art / "config.json").is_file()


def test_trackio_local_scalars_land(tmp_path, monkeypatch):
    pytest.importorskip("trackio", reason="trackio not installed (pip install -e .[trackers])")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    monkeypatch.setenv("TRACKIO_PROJECT", "trk-test")
    import trackio.sqlite_storage as st

    monkeypatch.setattr(st, "TRACKIO_DIR", tmp_path / "trackio", raising=False)
    _log_run(tmp_path, ["trackio"])
    logs = st.SQLiteStorage.get_logs("trk-test", "trk-run")
    assert [row["step"] for row in logs] == [1, 2, 3]
    for row, want in zip(logs, STEPS, strict=True):
        assert {k: row[k] for k in want} == want
    config = st.SQLiteStorage.get_run_config("trk-test", "trk-run")
    assert config["name"] == "trk-run" and config["train"]["lr"] == 3e-6
