"""Runs `pipeline-train` the way a user does, for end-to-end tests: a real launcher process from
the repository root, tagged so that every process it starts can be found afterwards, and checked
to exit as expected and leave no process behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import assert_no_process_left

REPO = Path(__file__).resolve().parents[3]
# A vLLM CPU engine for the tiny test model: short context, 1 GiB of KV cache.
SMALL_ENGINE = ("--engine.max_model_len", "256", "--engine.cpu_kvcache_space_gib", "1")


def tiny_args(model: Path, run_dir: Path, *, data: str = "arithmetic:200",
              producers: int = 1, batch_groups: int = 2, group_size: int = 4,
              max_tokens: int = 8) -> list[str]:
    """The options most e2e runs share: model, data, run dir, a small batch, a small engine."""
    return ["--model", str(model), "--data", data, "--num-producers", str(producers),
            "--batch-groups", str(batch_groups), "--group-size", str(group_size),
            "--max-tokens", str(max_tokens), "--run-dir", str(run_dir), *SMALL_ENGINE]


def pipeline_train(*args: str, tag: str, env: dict[str, str] | None = None,
                   timeout: float = 600, returncode: int = 0) -> subprocess.CompletedProcess:
    """`python -m pipeline.launch.cli ARGS`; asserts its exit code (stderr's tail on failure)
    and that nothing it started is still running. ``tag`` names the run among the machine's
    processes (PIPELINE_TEST_RUN, suffixed with this test process's pid); ``env`` adds to or
    overrides the environment, a value of "" removes the variable."""
    full_env = dict(os.environ, PIPELINE_TEST_RUN=f"{tag}{os.getpid()}",
                    PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                             os.environ.get("PYTHONPATH")])))
    for key, value in (env or {}).items():
        if value:
            full_env[key] = value
        else:
            full_env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "pipeline.launch.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env=full_env)
    assert proc.returncode == returncode, (proc.returncode, proc.stderr[-4000:])
    assert_no_process_left(full_env["PIPELINE_TEST_RUN"])
    return proc
