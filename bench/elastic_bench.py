"""Elastic producers on this machine (CPU): learner steps per second of one run before and after
a second producer joins it.

``python -m bench.elastic_bench --window 30`` starts `pipeline-train` on the tiny model (async,
max_staleness 1, one producer, ``--max_producers 2``, completions long enough that generation
bounds the step rate), measures steps per second over ``--window`` seconds, asks for a second
producer (`pipeline-train scale RUN --producers 2`), waits until the learner has taken it in and
its first groups arrived, measures the same window again, and prints both and their ratio. Both
windows come from the same run, so the machine's load is what it is for both. Writes ``--out``.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # the row being written
            break
    return out


def wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.5)


def steps_per_s(run_dir: Path, window: float) -> float:
    n0, t0 = len(rows(run_dir)), time.monotonic()
    time.sleep(window)
    return (len(rows(run_dir)) - n0) / (time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.elastic_bench", description=__doc__)
    ap.add_argument("--model", help="model dir (default: the tiny random-init test model)")
    ap.add_argument("--window", type=float, default=30.0, help="seconds measured each side")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="", help="write the figures here (JSON)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="more pipeline-train options, e.g. producer_gpus=['0','1'] on GPUs")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="elastic-bench-"))
    model = args.model
    if model is None:
        from pipeline.models import build_tiny_model

        model = str(build_tiny_model(tmp / "tiny-qwen2"))
    run_dir = tmp / "run"
    cmd = [sys.executable, "-m", "pipeline.launch.cli", "--model", model,
           "--data", "arithmetic:2000", "--reward", "pipeline.tasks.rewards:length_reward",
           "--num-producers", "1", "--max_producers", "2", "--batch-groups", "4",
           "--group-size", "8", "--max-tokens", str(args.max_tokens), "--mode", "async",
           "--max-staleness", "1", "--steps", "1000000", "--run-dir", str(run_dir),
           "--engine.max_model_len", str(max(256, args.max_tokens + 128)),
           "--engine.cpu_kvcache_space_gib", "1",
           "--tensorboard", "false", "--progress", "false", "--train.checkpoint_every", "0",
           *(x for kv in args.set for x in ("--set", kv))]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait(lambda: len(rows(run_dir)) >= 5, 900, "the first steps")
        one = steps_per_s(run_dir, args.window)
        print(f"1 producer: {one:.2f} steps/s", flush=True)
        subprocess.run([sys.executable, "-m", "pipeline.launch.cli", "scale", str(run_dir),
                        "--producers", "2"], cwd=REPO, check=True)
        t0 = time.monotonic()
        wait(lambda: rows(run_dir)[-1].get("by_producer/p1/groups_sent", 0) > 0, 900,
             "the second producer's groups")
        join_s = time.monotonic() - t0
        two = steps_per_s(run_dir, args.window)
        print(f"2 producers: {two:.2f} steps/s (joined {join_s:.0f} s after the request)",
              flush=True)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(300)
    result = {"steps_per_s_1_producer": one, "steps_per_s_2_producers": two,
              "ratio": two / one if one else float("nan"), "join_s": join_s,
              "window_s": args.window, "max_tokens": args.max_tokens, "cmd": cmd}
    print(f"after the join / before: {result['ratio']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
