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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
    t0 = time.time()
    proc = subprocess.run(
        cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    total = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{launcher} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [
        json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()
    ]
    first, last = rows[0]["ts"], rows[-1]["ts"]
    later = len(rows) - 1
    samples = sum(4 * 4 for _ in rows[1:])  # batch_groups x group_size per step
    return {
        "launcher": launcher,
        "steps": len(rows),
        "first_step_s": round(first - t0, 1),
        "steps_per_s": round(later / max(last - first, 1e-9), 3),
        "samples_per_s": round(samples / max(last - first, 1e-9), 1),
        "total_s": round(total, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--model", default="tiny")
    p.add_argument("--out", default="launcher_bench.json")
    p.add_argument("extra", nargs="*", help="more pipeline-train flags for both runs")
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="launcher-bench-") as tmp:
        for r in range(args.repeat):
            for launcher in ("local", "ray"):
                row = one_run(
                    launcher, args.steps, args.model, Path(tmp) / f"{launcher}-{r}", args.extra
                )
                results.append(row)
                print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
