"""LaunchedLearner's command: a free rendezvous port per start unless the accelerate config
names one (Popen is replaced by a recorder: pure command-building logic)."""

from __future__ import annotations

import pipeline.launch.local as launch
from pipeline.config import load_config


def _started_cmd(monkeypatch, tmp_path, accelerate_config: str = "") -> list[str]:
    seen = {}

    class RecordingPopen:
        def __init__(self, cmd, **_kw):
            seen["cmd"] = cmd
            self.pid = 1

    monkeypatch.setattr(launch.subprocess, "Popen", RecordingPopen)
    cfg = load_config(overrides={"run_dir": str(tmp_path), "train.learner_processes": 2,
                                 "train.accelerate_config": accelerate_config})
    launch.LaunchedLearner(cfg, "/model", resume=False).start()
    return seen["cmd"]


def test_each_start_gets_a_free_rendezvous_port_fake_popen(monkeypatch, tmp_path):
    cmd = _started_cmd(monkeypatch, tmp_path)
    port = int(cmd[cmd.index("--main_process_port") + 1])
    assert 1024 <= port <= 65535
    # accelerate's options come before the script; the script's own after it
    assert cmd.index("--main_process_port") < cmd.index("pipeline.learner.main")


def test_a_port_in_the_accelerate_config_is_kept_fake_popen(monkeypatch, tmp_path):
    cfg = tmp_path / "acc.yaml"
    cfg.write_text("distributed_type: MULTI_GPU\nmain_process_port: 29612\n")
    assert "--main_process_port" not in _started_cmd(monkeypatch, tmp_path, str(cfg))
    plain = tmp_path / "plain.yaml"
    plain.write_text("distributed_type: MULTI_GPU\n")
    assert "--main_process_port" in _started_cmd(monkeypatch, tmp_path, str(plain))
