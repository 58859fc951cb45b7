"""How fast each way of writing a trainer state to a disk goes: the measurement behind the
checkpoint format (``pipeline.learner.checkpoint``).

    python -m bench.checkpoint_formats [--dir /tmp] [--gb 1.2] [--threads 4,8]

Writes the same fp32 tensors (about ``--gb``, in 120 tensors of 4-16 MB at 1.26 GB) with: one
``torch.save`` stream (the layout checkpoints had before); ``safetensors.torch.save_file`` in
``--threads`` files at once (what checkpoints use); a hand-written safetensors-format writer
(header then each tensor's memory, no copy) in as many threads; and
``torch.distributed.checkpoint``'s ``FileSystemWriter`` with ``thread_count``. Each is timed to
its fsync; one Markdown row each. The disk's own speed: ``dd if=/dev/zero of=DIR/x bs=16M
count=128 conv=fsync`` (and ``oflag=direct``) beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _fsync_tree(top: Path) -> None:
    for dirpath, _dirs, files in os.walk(top):
        for name in files:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def _parts(state: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    sizes = [0] * n
    for k, t in sorted(state.items(), key=lambda kv: -kv[1].numel()):
        i = sizes.index(min(sizes))
        parts[i][k] = t
        sizes[i] += t.numel() * t.element_size()
    return parts


def _raw_safetensors(path: Path, part: dict[str, torch.Tensor]) -> None:
    header, off = {}, 0
    for k, t in part.items():
        n = t.numel() * t.element_size()
        header[k] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for t in part.values():
            f.write(memoryview(t.numpy()).cast("B"))


def _threaded(fn, d: Path, state: dict, n: int) -> None:
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda ip: fn(d / f"s{ip[0]}.safetensors", ip[1]),
                      enumerate(_parts(state, n))))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--gb", type=float, default=1.2)
    ap.add_argument("--threads", default="4,8")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    scale = max(1, round(args.gb / 1.26))  # 1.26 GB at scale 1
    state = {f"t{i}": torch.randn(1024 * scale, 1024 * (1 + i % 4)) for i in range(120)}
    nbytes = sum(t.numel() * 4 for t in state.values())

    def dcp(d: Path, n: int) -> None:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=dcp.FileSystemWriter(d, thread_count=n,
                                                                sync_files=False), no_dist=True)

    ways = [("torch.save, one stream", lambda d, n: torch.save(state, d / "x.pt"), 1)]
    for n in (int(x) for x in args.threads.split(",")):
        ways += [(f"safetensors save_file, {n} threads", lambda d, n: _threaded(
                     lambda p, part: save_file(part, p), d, state, n), n),
                 (f"safetensors layout by hand, {n} threads",
                  lambda d, n: _threaded(_raw_safetensors, d, state, n), n),
                 (f"torch.distributed.checkpoint, {n} threads", dcp, n)]
    root = Path(tempfile.mkdtemp(prefix="ckpt-formats-", dir=args.dir))
    print(f"| way ({nbytes / 1e9:.2f} GB to {args.dir}) | s to fsync | GB/s |\n|---|---|---|")
    try:
        for name, fn, n in ways:
            d = root / "x"
            d.mkdir()
            os.sync()
            t0 = time.monotonic()
            fn(d, n)
            _fsync_tree(d)
            s = time.monotonic() - t0
            print(f"| {name} | {s:.2f} | {nbytes / 1e9 / s:.2f} |", flush=True)
            if name.startswith("safetensors layout"):  # what it wrote is plain safetensors
                got: dict = {}
                for f in d.glob("*.safetensors"):
                    got.update(load_file(f))
                assert all(torch.equal(got[k], v) for k, v in state.items())
            shutil.rmtree(d)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
