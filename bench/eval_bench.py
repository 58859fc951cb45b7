"""Training throughput with evaluation on every version: no evaluation, producer 0 evaluating
between its admissions (``eval.producer shared``), and a dedicated evaluator with its own
engine (``eval.producer dedicated``), on this machine.

``python -m bench.eval_bench --steps 24 --repeat 2`` runs `pipeline-train` on the tiny model (one
producer, async, max_staleness 1, 4 groups x 4 completions a step) once per mode and round, the
modes alternating, with 8 held-out prompts x 4 samples evaluated on every version
(``eval.every 1``). One row per run:

- ``steps_per_s`` and ``samples_per_s``: training steps over the steps after the first (start-up
  excluded), from the learner's metrics rows;
- ``evaluations``: evaluation rows logged (versions evaluated); ``eval_s``: their summed
  ``eval/seconds``; ``skipped``: due versions the dedicated evaluator let go by while busy
  (``evaluator/versions_skipped``); ``behind``: its mean ``eval/versions_behind``;
- ``total_s``: the command's wall time, teardown included.

On a CPU machine the dedicated evaluator's engine gets its own slice of the cores
(``pipeline.producer.engine.cpu_cores``), so the producer's engine gets fewer than when it is
alone: the comparison is of the same machine split two ways. Writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.launcher_bench import bench_parser, rates, rounds, run_train


def heldout(path: Path, n: int = 16) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{a}+{a + 1}=", "answer": str(2 * a + 1)})
                            + "\n" for a in range(n)))
    return path


def command(mode: str, args: argparse.Namespace, run_dir: Path, data: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pipeline.launch.cli", "--model", args.model,
           "--data", "arithmetic:5000", "--num-producers", "1",
           "--batch-groups", str(args.batch_groups), "--group-size", str(args.group_size),
           "--max-tokens", str(args.max_tokens), "--mode", "async", "--max-staleness", "1",
           "--steps", str(args.steps), "--run-dir", str(run_dir),
           "--engine.max_model_len", "256", "--engine.cpu_kvcache_space_gib", "1",
           "--tensorboard", "false", "--progress", "false"]
    if mode != "off":
        cmd += ["--eval.data", str(data), "--eval.every", "1", "--eval.samples_per_prompt", "4",
                "--eval.max_prompts", str(args.eval_prompts), "--eval.producer", mode]
    return cmd + args.extra


def one_run(mode: str, args: argparse.Namespace, run_dir: Path, data: Path) -> dict:
    _, total, rows = run_train(command(mode, args, run_dir, data), run_dir, mode,
                               timeout=args.run_timeout)
    train = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval/version" in r]
    behind = [r["eval/versions_behind"] for r in evals if "eval/versions_behind" in r]
    return {
        "mode": mode,
        "steps": len(train),
        **rates(train, args.batch_groups * args.group_size),
        "evaluations": len(evals),
        "eval_s": round(sum(r.get("eval/seconds", 0.0) for r in evals), 1),
        "skipped": int(train[-1].get("evaluator/versions_skipped", 0)),
        "behind": round(sum(behind) / len(behind), 2) if behind else None,
        "total_s": round(total, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, steps=24)
    p.add_argument("--modes", default="off,shared,dedicated")
    p.add_argument("--batch-groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts (x4 samples)")
    p.add_argument("--run-timeout", type=float, default=1800)
    p.add_argument("--runs-dir", default="", help="keep each run's directory here")
    p.add_argument("--out", default="eval_bench.json")
    p.add_argument("extra", nargs="*", help="more pipeline-train flags for every run")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="eval-bench-") as tmp:
        root = Path(args.runs_dir or tmp)
        data = heldout(Path(tmp) / "heldout.jsonl", max(16, args.eval_prompts))
        rounds(args.repeat, args.modes.split(","),
               lambda mode, name: one_run(mode, args, root / name, data), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
