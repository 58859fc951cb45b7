"""`pipeline-train`: fast --help, and bad configs fail fast (exit 2, one message, no process)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]


def _cli(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pipeline.launch.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


def test_help_is_fast_and_lists_generated_options():
    exe = Path(sys.executable).parent / "pipeline-train"
    cmd = [str(exe), "--help"] if exe.is_file() else [sys.executable, "-m", "pipeline.launch.cli",
                                                       "--help"]
    subprocess.run(cmd, cwd=REPO, capture_output=True, timeout=60)  # warm the page cache
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    # Fast by construction: --help imports none of the heavy libraries (checked exactly); the
    # time bound only catches gross regressions, with room for a busy machine.
    assert elapsed < 10, f"--help took {elapsed:.2f}s"
    probe = ("import sys\nfrom pipeline.launch import cli\n"
             "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
             "print('HEAVY', sorted(m for m in ('torch', 'vllm', 'transformers', 'ray', 'zmq')"
             " if m in sys.modules), file=sys.stderr)")
    heavy = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
    assert "HEAVY []" in heavy.stderr, heavy.stderr[-2000:]
    for flag in ("--train.max_staleness", "--max-staleness", "--mode", "--train.lr",
                 "--sync.barrier", "--resume", "--max-producer-restarts", "--set"):
        assert flag in proc.stdout, flag
    # Help text comes from the config dataclasses.
    assert "checkpoint" in proc.stdout


def _base(tiny_model: Path, run_dir: Path) -> list[str]:
    return ["--model", str(tiny_model), "--data", "arithmetic:10",
            "--reward", "pipeline.tasks.rewards:length_reward", "--run-dir", str(run_dir)]


@pytest.mark.parametrize(("extra", "names"), [
    (["--set", "nosuch.key=1"], "nosuch.key"),
    (["--set", "train.steps=0"], "train.steps"),
    (["--steps", "0"], "train.steps"),
    (["--set", "train.max_staleness=-1"], "train.max_staleness"),
    (["--model", "/nonexistent"], "model.path"),
    (["--reward", "nosuchmodule:fn"], "nosuchmodule"),
    (["--data", "/nonexistent.jsonl"], "data.path"),
    (["--set", "addr=tcp://0.0.0.0:5555"], "addr"),
    (["--sync.serve_stream", "tcp://0.0.0.0:5557"], "sync.serve_stream: refusing to bind"),
    (["--sync.serve_stream", "0.0.0.0:5557"], "sync.serve_stream: must look like tcp://"),
    (["--set", "engine.extra={swap_spce: 1}"], "engine.extra: unknown vLLM engine argument"),
])
def test_bad_config_fails_fast_with_one_message(tiny_model, tmp_path, extra, names):
    run_dir = tmp_path / "run"
    proc, elapsed = _cli(*_base(tiny_model, run_dir), *extra)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    # argparse errors print the usage line first; config errors print exactly one line.
    msg = [ln for ln in lines if not ln.startswith(("usage:", " "))]
    assert len(msg) == 1, proc.stderr
    assert names in msg[0], msg[0]
    assert "Traceback" not in proc.stderr
    # Nothing started: the launcher writes run_dir/config.yaml just before spawning processes.
    assert not run_dir.exists()
    assert elapsed < 30, elapsed


def test_bind_check_only_for_the_learner_and_lifted_by_insecure(tiny_model, tmp_path):
    """A producer connects to a remote learner; only the binding side is checked."""
    from pipeline.config import load_config
    from pipeline.launch.preflight import prepare
    from pipeline.options import ConfigError

    cfg = load_config(overrides={"model.path": str(tiny_model), "data.path": "arithmetic:10",
                                 "rewards.specs": [{"fn": "pipeline.tasks.rewards:length_reward",
                                                    "weight": 1.0}],
                                 "addr": "tcp://10.1.2.3:5555", "run_dir": str(tmp_path)})
    assert prepare(cfg, role="producer") == str(tiny_model)
    with pytest.raises(ConfigError, match="addr"):
        prepare(cfg, role="learner")
    cfg.insecure = True
    assert prepare(cfg, role="all") == str(tiny_model)



@pytest.mark.parametrize("bad, option", [
    ({"data.path": "/nonexistent/prompts.jsonl"}, "data.path"),
    ({"rewards.specs": [{"fn": "pipeline.tasks.rewards:no_such_reward"}]}, "rewards.specs"),
    # A sampled distribution the learner could not recompute (trained_sampling).
    ({"engine.extra": {"logprobs_mode": "raw_logprobs"}}, "engine.extra.logprobs_mode"),
    ({"engine.extra": {"logits_processors": ["m:P"]}}, "engine.extra.logits_processors"),
    ({"generation.temperature": 1e-9}, "generation: temperature 1e-09 cannot be trained"),
])
def test_checks_that_need_no_model_fail_before_it_is_built(tmp_path, bad, option):
    """A mistyped option is one line before the model is resolved, which builds or converts
    it on first use (the demo's SmolLM2: a minute and a progress bar)."""
    from pipeline.config import load_config
    from pipeline.launch.preflight import prepare
    from pipeline.options import ConfigError

    models = tmp_path / "models"
    cfg = load_config(overrides={"model.path": "tiny", "model.cache_dir": str(models),
                                 "data.path": "arithmetic:10", "run_dir": str(tmp_path / "run"),
                                 **bad})
    with pytest.raises(ConfigError, match=option):
        prepare(cfg)
    assert not models.exists()


def test_curve_keys_lift_the_bind_check_and_a_producer_without_them_is_refused(tiny_model,
                                                                               tmp_path):
    from pipeline.config import load_config
    from pipeline.launch.preflight import prepare
    from pipeline.options import ConfigError

    keys = tmp_path / "keys"
    cfg = load_config(overrides={"model.path": str(tiny_model), "data.path": "arithmetic:10",
                                 "rewards.specs": [{"fn": "pipeline.tasks.rewards:length_reward",
                                                    "weight": 1.0}],
                                 "addr": "tcp://0.0.0.0:5555", "run_dir": str(tmp_path),
                                 "curve_keys": str(keys)})
    with pytest.raises(ConfigError, match="curve_keys: CURVE keys missing"):
        prepare(cfg, role="producer")  # the learner's directory was never copied here
    assert prepare(cfg, role="learner") == str(tiny_model)  # encrypted: no --insecure needed
    assert (keys / "server.key_secret").is_file() and (keys / "client.key_secret").is_file()
    assert prepare(cfg, role="producer") == str(tiny_model)

def test_impossible_pinned_placement_is_a_config_error_fake_gpu_count(monkeypatch, capsys,
                                                                      tmp_path):
    """nccl with the producer on the learner's GPU is refused before anything starts (the GPU
    count is faked: this machine has none)."""
    import pipeline.launch.placement as placement
    from pipeline.launch.cli import main

    monkeypatch.setattr(placement, "cuda_device_count", lambda: 2)
    code = main(["--model", "tiny", "--run-dir", str(tmp_path / "run"), "--sync.route",
                 "nccl", "--producer_gpus", '["0"]', "--learner_gpus", "0"])
    assert code == 2
    assert "sync.route: producer_gpus[0]" in capsys.readouterr().err
