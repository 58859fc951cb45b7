"""Shared fixtures: the tiny random model, vLLM CPU settings, and a child-process leak check."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import psutil
import pytest

# The CPU build of vLLM sizes its KV cache from this (GiB); tests keep it small.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and os.path.exists("/dev/nvidia0")


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the device tool, see README)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A random-init 2-layer Qwen2 (head_dim 64) with a byte-level tokenizer, built once."""
    from pipeline.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


def live_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]


def assert_no_children(timeout: float = 15.0) -> None:
    """Every child process (vLLM engine cores, workers) has exited."""
    _gone, alive = psutil.wait_procs(live_children(), timeout=timeout)
    alive = [p for p in alive if "resource_tracker" not in " ".join(p.cmdline())]
    assert not alive, f"child processes left behind: {[(p.pid, p.name()) for p in alive]}"


def assert_no_process_left(tag: str) -> None:
    """No process that inherited ``PIPELINE_TEST_RUN=tag`` (a launcher's children, vLLM engine
    cores and workers) is still alive."""
    def tagged(p: psutil.Process) -> bool:
        try:
            return p.environ().get("PIPELINE_TEST_RUN") == tag
        except (psutil.Error, OSError):
            return False

    _gone, alive = psutil.wait_procs([p for p in psutil.process_iter() if tagged(p)], timeout=10)
    assert not alive, f"processes left behind: {[(p.pid, p.name()) for p in alive]}"
