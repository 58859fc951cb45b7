"""Does the checkpoint writer hold the GIL while the learner trains beside it?

A training step launches its kernels from Python; a writer thread that held the GIL for the
length of a file write would hold those launches back. This runs the learner's own writer
(``write_tensors``, one thread, so that two cores are not contended) beside a thread that spins
in Python, and prints the spinner's longest wait and its rate, against a plain ``file.write`` of
the same bytes (which releases the GIL) and the spinner alone.

    python -m bench.writer_gil --gb 1
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pipeline.learner.checkpoint import write_tensors


def spin_beside(work: Callable[[], None]) -> tuple[float, float, float]:
    """(seconds ``work`` took, the spinner's longest wait in seconds, its iterations/s)."""
    stop = threading.Event()
    out: list[float] = []

    def spin() -> None:
        last = time.perf_counter()
        worst, n = 0.0, 0
        while not stop.is_set():
            now = time.perf_counter()
            worst = max(worst, now - last)
            last = now
            n += 1
        out.extend([worst, n])

    th = threading.Thread(target=spin)
    th.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    try:
        work()
    finally:
        took = time.perf_counter() - t0
        stop.set()
        th.join()
    return took, out[0], out[1] / (took + 0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="bytes written per run, in GB")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    n = int(args.gb * (1 << 30)) // 4 // 4
    tensors = {f"t{i}": torch.ones(n) for i in range(4)}
    root = Path(args.dir or tempfile.mkdtemp(prefix="writer-gil-"))
    root.mkdir(parents=True, exist_ok=True)

    def ours() -> None:
        d = root / "ours"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        write_tensors(d, tensors, threads=1)

    def plain() -> None:
        with open(root / "plain.bin", "wb") as f:
            for t in tensors.values():
                f.write(memoryview(t.numpy()).cast("B"))

    print("| writer | write s | spinner's longest wait ms | spinner M iterations/s |")
    print("|---|---|---|---|")
    _, worst, rate = spin_beside(lambda: time.sleep(1.0))
    print(f"| none (spinner alone, 1 s) | | {worst * 1e3:.0f} | {rate / 1e6:.2f} |")
    for name, fn in [("write_tensors (safetensors)", ours), ("plain file.write", plain)] * 2:
        took, worst, rate = spin_beside(fn)
        print(f"| {name} | {took:.2f} | {worst * 1e3:.0f} | {rate / 1e6:.2f} |")
    if args.dir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
