"""The cost of checkpointing every step in a real run: two ``bench.gpu_bench`` outputs of the
same run, without and with ``train.checkpoint_every=1``, side by side.

    python -m bench.checkpoint_runs OUT_NONE OUT_EVERY1 [--run async1]

Prints one Markdown table: samples/s of each (gpu_bench's steady window) and their ratio, and
from the checkpointing run's ``metrics.jsonl``: the stall per checkpoint (largest and median,
the first included), checkpoints written, skipped and failed, and the write's GB/s; then each
checkpoint's stall in its parts.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def samples_per_s(out: Path, run: str) -> float | None:
    try:
        results = json.loads((out / "results.json").read_text())["results"]
    except (OSError, ValueError, KeyError):
        return None
    return next((r.get("samples_per_s") for r in results if r.get("name") == run), None)


def rows(out: Path, run: str) -> list[dict]:
    path = out / run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def table(none: Path, every: Path, run: str = "async1") -> str:
    a, b = samples_per_s(none, run), samples_per_s(every, run)
    m = rows(every, run)
    stalls = [r["checkpoint_stall_s"] for r in m if r.get("checkpoint_stall_s")]
    gbps = [r["checkpoint_write_gbps"] for r in m if "checkpoint_write_gbps" in r]
    last = m[-1] if m else {}
    fmt = lambda x, f="{:.2f}": "n/a" if x is None else f.format(x)  # noqa: E731
    return "\n".join([
        "| samples/s, no checkpoints | samples/s, checkpoint_every 1 | ratio | stall s max "
        "(first) | stall s median | written | skipped | failed | write GB/s |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {fmt(a)} | {fmt(b)} | {fmt(b / a if a and b else None)} "
        f"| {fmt(max(stalls) if stalls else None, '{:.3f}')} "
        f"({fmt(stalls[0] if stalls else None, '{:.3f}')}) "
        f"| {fmt(statistics.median(stalls) if stalls else None, '{:.3f}')} "
        f"| {sum(1 for r in m if 'checkpoint_write_s' in r)} "
        f"| {int(last.get('checkpoints_skipped', 0))} | {int(last.get('checkpoint_failures', 0))} "
        f"| {fmt(statistics.median(gbps) if gbps else None)} |"])


PARTS = ("checkpoint_thread_wait_s", "checkpoint_state_s", "checkpoint_copy_start_s",
         "checkpoint_resume_s")


def parts_table(every: Path, run: str = "async1") -> str:
    """Each checkpoint's stall in its parts (``CheckpointWriter.stall_parts``), by step."""
    m = [r for r in rows(every, run) if r.get("checkpoint_stall_s")]
    head = ["step", "stall s", *(p.removeprefix("checkpoint_").removesuffix("_s") + " s"
                                  for p in PARTS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in m:
        cells = [str(r["step"]), f"{r['checkpoint_stall_s']:.3f}",
                 *(f"{r[p]:.3f}" if p in r else "n/a" for p in PARTS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("none", type=Path)
    ap.add_argument("every", type=Path)
    ap.add_argument("--run", default="async1")
    args = ap.parse_args(argv)
    print(table(args.none, args.every, args.run))
    print()
    print(parts_table(args.every, args.run))


if __name__ == "__main__":
    main()
