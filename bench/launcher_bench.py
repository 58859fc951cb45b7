"""Ray launcher vs local launcher on this machine (CPU): seconds from the command to the first
trained step, and throughput of the same run under both.

``python -m bench.launcher_bench --steps 20`` runs `pipeline-train` on the tiny model (2 producers,
async, max_staleness 1) once with ``--launcher local`` and once with ``--launcher ray`` (a private
Ray node started by the driver, producers streaming their weights so the cross-node path is
measured too), and prints one row per launcher:

- ``first_step_s``: from starting the command to the first metrics row (the first trained step);
- ``steps_per_s`` and ``samples_per_s``: over the steps after the first (start-up excluded);
- ``total_s``: the command's wall time, teardown included.

Writes ``--out`` (JSON). Runs are sequential; on a shared machine repeat with ``--repeat``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_train(
    cmd: list[str], run_dir: Path, label: str, timeout: float | None = None
) -> tuple[float, float, list[dict]]:
    """Run a `pipeline-train` command with its output dropped: its start time, its wall time and
    the metrics rows it wrote; a failed run stops the benchmark with the tail of its stderr."""
    t0 = time.time()
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=timeout,
    )
    total = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{label} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [
        json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()
    ]
    return t0, total, rows


def rates(rows: list[dict], samples_per_step: int) -> dict:
    """Steps and samples a second over the steps after the first (start-up excluded)."""
    first, last = rows[0]["ts"], rows[-1]["ts"]
    later = len(rows) - 1
    return {
        "steps_per_s": round(later / max(last - first, 1e-9), 3),
        "samples_per_s": round(later * samples_per_step / max(last - first, 1e-9), 1),
    }


def rounds(repeat: int, variants: Sequence[str], run: Callable[[str, str], dict], out: str) -> None:
    """Every variant once a round, alternating, so a slow spell of a shared machine hits all of
    them; ``run(variant, run_name)`` gives a row, printed as a JSON line as it comes; all rows
    are then written to ``out``."""
    results = []
    for r in range(repeat):
        for variant in variants:
            row = run(variant, f"{variant}-{r}")
            results.append(row)
            print(json.dumps(row), flush=True)
    Path(out).write_text(json.dumps(results, indent=1))


def bench_parser(doc: str, steps: int) -> argparse.ArgumentParser:
    """The flags both `pipeline-train` benchmarks start with: run length, rounds and model."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--model", default="tiny")
    return p


def one_run(launcher: str, steps: int, model: str, run_dir: Path, extra: list[str]) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "pipeline.launch.cli",
        "--model",
        model,
        "--data",
        "arithmetic:2000",
        "--reward",
        "pipeline.tasks.rewards:length_reward",
        "--num-producers",
        "2",
        "--batch-groups",
        "4",
        "--group-size",
        "4",
        "--max-tokens",
        "16",
        "--mode",
        "async",
        "--max-staleness",
        "1",
        "--steps",
        str(steps),
        "--run-dir",
        str(run_dir),
        "--engine.max_model_len",
        "256",
        "--engine.cpu_kvcache_space_gib",
        "1",
        "--tensorboard",
        "false",
        "--progress",
        "false",
        "--launcher",
        launcher,
        *extra,
    ]
    if launcher == "ray":
        cmd += ["--set", "launch.stream_weights=always"]
    t0, total, rows = run_train(cmd, run_dir, launcher)
    return {
        "launcher": launcher,
        "steps": len(rows),
        "first_step_s": round(rows[0]["ts"] - t0, 1),
        **rates(rows, 4 * 4),  # batch_groups x group_size per step
        "total_s": round(total, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, steps=20)
    p.add_argument("--out", default="launcher_bench.json")
    p.add_argument("extra", nargs="*", help="more pipeline-train flags for both runs")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="launcher-bench-") as tmp:

        def run(launcher: str, name: str) -> dict:
            return one_run(launcher, args.steps, args.model, Path(tmp) / name, args.extra)

        rounds(args.repeat, ("local", "ray"), run, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
