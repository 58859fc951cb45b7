"""The learner/engine logprob mismatch and samples/s of training runs under given sampling
settings, this checkout against another one (before and after a change), in one call.

    python -m bench.sampled_runs --model PATH [--legacy-root .legacy] [--layout colocated]
        [--runs before:0.7:0.95,after:0.7:0.95,before:1:1,after:1:1] [--steps 8] [--out DIR]

Each run is ``pipeline-train`` in sync mode (staleness 0: the mismatch at lag 0 is the
engine's and the learner's numbers alone) with ``generation.temperature`` and ``top_p`` from
its ``NAME:T:P`` entry; ``before`` runs from ``--legacy-root`` (``git archive <commit>
pipeline buffer sync | tar -x -C .legacy``: its packages come first, this checkout's bench and
config do the rest), ``after`` from this checkout. One Markdown row per run: the mean over its
steps of ``loss/mismatch_abs`` and ``loss/mismatch_kl``, samples/s over the steps after the
warm-up (``bench.gpu_bench.summarize``), peak GPU memory; and after/before ratios of samples/s
for each setting. On a GPU the runs share GPU 0 (colocated) or use GPUs 0 and 1 (split).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from bench.gpu_bench import LAYOUTS, _read_jsonl, _timed, _yaml_float


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return sum(vals) / len(vals) if vals else None


def run(args: argparse.Namespace, entry: str, out: Path, repeat: int = 0) -> dict:
    code, temp, top_p = entry.split(":")
    name = f"{code}-T{temp}-p{top_p}" + (f"-{repeat + 1}" if repeat else "")
    run_dir = (out / name).resolve()
    producer_gpus, learner_gpus, roles = LAYOUTS[args.layout]
    cmd = [sys.executable, "-m", "pipeline.launch.cli", "--config", str(args.config.resolve()),
           "--name", f"sampled-{name}", "--run_dir", str(run_dir),
           "--model.path", args.model, "--train.mode", "sync", "--train.steps", str(args.steps),
           "--train.batch_groups", str(args.batch_groups),
           "--generation.group_size", str(args.group_size),
           "--generation.max_tokens", str(args.max_tokens),
           "--generation.temperature", temp, "--generation.top_p", top_p,
           "--train.lr", _yaml_float(args.lr), "--tensorboard", "false"]
    if args.gpu_mem:
        cmd += ["--engine.gpu_memory_utilization", str(args.gpu_mem)]
    if args.layout != "cpu":
        cmd += ["--producer_gpus", json.dumps(producer_gpus), "--learner_gpus", learner_gpus]
    for kv in args.set:
        cmd += ["--set", kv]
    env = None
    if code == "before":  # the other checkout's packages first: run from its root
        root = Path(args.legacy_root).resolve()
        # Prepended: the GPU machine's activate.sh puts vLLM's and the wheels' site there.
        path = os.pathsep.join(p for p in (str(root), str(Path.cwd()),
                                           os.environ.get("PYTHONPATH", "")) if p)
        env = os.environ | {"PYTHONPATH": path}
        cmd = ["env", "-C", str(root), *cmd]
    res = _timed(args, name, cmd, run_dir / "metrics.jsonl", roles if args.layout != "cpu"
                 else {}, out / f"{name}.log", env=env)
    rows = _read_jsonl(run_dir / "metrics.jsonl")
    return {"name": name, "code": code, "setting": f"T {temp}, top-p {top_p}",
            "mismatch_abs": _mean(rows, "loss/mismatch_abs"),
            "mismatch_kl": _mean(rows, "loss/mismatch_kl"), **asdict(res)}


def table(results: list[dict]) -> str:
    lines = ["| run | setting | steps | loss/mismatch_abs | loss/mismatch_kl | samples/s | "
             "GPU peak GB |", "|---|---|---|---|---|---|---|"]
    fmt = lambda x, f: "n/a" if x is None else format(x, f)  # noqa: E731
    for r in results:
        peak = max(r.get("gpu_mem_peak_gb", {}).values(), default=None)
        lines.append(f"| {r['code']} | {r['setting']} | {r['steps']} | "
                     f"{fmt(r['mismatch_abs'], '.4f')} | {fmt(r['mismatch_kl'], '.4f')} | "
                     f"{fmt(r['samples_per_s'], '.2f')} | {fmt(peak, '.1f')} |"
                     + ("" if r["ok"] else f" failed: {r.get('note', '')[:120]}"))
    for setting in dict.fromkeys(r["setting"] for r in results):
        mean = {code: [r["samples_per_s"] for r in results if r["setting"] == setting
                       and r["code"] == code and r["samples_per_s"]] for code in ("before",
                                                                                  "after")}
        if mean["before"] and mean["after"]:
            a, b = (sum(v) / len(v) for v in (mean["after"], mean["before"]))
            lines.append(f"\nafter / before samples/s at {setting} (mean of "
                         f"{len(mean['after'])} and {len(mean['before'])} runs): {a / b:.3f}")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--legacy-root", default=".legacy")
    p.add_argument("--layout", choices=[*sorted(LAYOUTS), "cpu"], default="colocated")
    p.add_argument("--runs", default="before:0.7:0.95,after:0.7:0.95,before:1.0:1.0,"
                                     "after:1.0:1.0")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--batch-groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--gpu-mem", type=float, default=0.3)
    p.add_argument("--config", type=Path, default=Path(__file__).with_name("bench.yaml"))
    p.add_argument("--set", action="append", default=[], help="extra KEY=VALUE for every run")
    p.add_argument("--run-timeout", type=float, default=240.0)
    p.add_argument("--gpus", default="")
    p.add_argument("--out", type=Path, default=Path("runs/sampled"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    entries = args.runs.split(",")  # a repeated entry runs again (interleaved A/B repeats)
    results = [run(args, e, args.out, entries[:i].count(e)) for i, e in enumerate(entries)]
    text = table(results)
    print(text)
    (args.out / "results.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
