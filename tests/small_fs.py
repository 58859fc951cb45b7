"""A real small filesystem for the full-disk tests: a tmpfs of a few megabytes mounted on a
test's directory (needs root: skipped with the reason otherwise), and a filler that takes every
free byte of it."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_filesystem(path: Path, megabytes: int) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs",
                           str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> None:
    """Take every free byte of ``path``'s filesystem (written until the disk refuses)."""
    with open(path, "wb", buffering=0) as f:
        for size in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * size)
