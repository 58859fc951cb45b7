"""The memory plan and weight-sync volume of a layout on paper, from the launcher's own plan.

    python -m bench.memory_plan                 # the layouts of docs/cluster.md ("72B on paper")
    python -m bench.memory_plan --json out.json

Each row is ``pipeline.memory.plan`` (what ``pipeline-train`` checks before it starts) for one
GPU of the layout: the learner's state (parameters x bytes per parameter / ranks) plus the
engines' share, a lower bound (activations, CUDA context and fragmentation come on top). The
weight sync columns are the bytes one version moves (bf16 weights, whole model) and the seconds
that takes at a stated link bandwidth: an estimate to check against a measured run, not a figure
measured here.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.gpu_model import SIZES
from pipeline.memory import GB, LearnerSetup, bytes_per_param, model_parameters, plan

QWEN_72B = dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, intermediate_size=29568, vocab_size=152064,
                tie_word_embeddings=False, model_type="qwen2")
SHAPES = {**{k: {**v, "model_type": "qwen2"} for k, v in SIZES.items()}, "72b": QWEN_72B}
H100, H200 = 80 * 2**30, 141e9


@dataclass(frozen=True)
class Layout:
    name: str
    size: str
    gpu_bytes: float
    setup: LearnerSetup
    learner_gpus: list[str]
    producer_gpus: list[list[str]]   # one list per producer (its tensor-parallel GPUs)
    engine_util: float
    link_gb_s: float                 # assumed bandwidth of the weight route, GB/s


def _gpus(node: int, first: int, count: int) -> list[str]:
    return [f"n{node}:{first + i}" for i in range(count)]


def layouts() -> list[Layout]:
    """7B as measured on 2 H200, and 72B on 4 nodes x 8 H100 80 GB three ways."""
    learner16 = _gpus(0, 0, 8) + _gpus(1, 0, 8)
    learner24 = learner16 + _gpus(2, 0, 8)
    every = learner24 + _gpus(3, 0, 8)
    return [
        Layout("7B colocated-2 (2 H200, ZeRO-3, engine share 0.3)", "7b", H200,
               LearnerSetup(ranks=2, zero_stage=3), ["0", "1"], [["0"], ["1"]], 0.3, 25.0),
        Layout("7B colocated-2 (2 H200, FSDP2, engine share 0.3)", "7b", H200,
               LearnerSetup(ranks=2, fsdp2=True), ["0", "1"], [["0"], ["1"]], 0.3, 25.0),
        Layout("72B split: learner ZeRO-3 + optimizer offload on nodes 0-1, "
               "4 producers TP=4 on nodes 2-3", "72b", H100,
               LearnerSetup(ranks=16, zero_stage=3, offload_optimizer=True), learner16,
               [_gpus(n, f, 4) for n in (2, 3) for f in (0, 4)], 0.9, 25.0),
        Layout("72B split: learner ZeRO-3 on nodes 0-2, 2 producers TP=4 on node 3", "72b",
               H100, LearnerSetup(ranks=24, zero_stage=3), learner24,
               [_gpus(3, 0, 4), _gpus(3, 4, 4)], 0.9, 25.0),
        Layout("72B colocated: learner ZeRO-3 over all 32 GPUs, 4 producers TP=8 "
               "(engine share 0.35)", "72b", H100, LearnerSetup(ranks=32, zero_stage=3),
               every, [_gpus(n, 0, 8) for n in range(4)], 0.35, 25.0),
    ]


def row(lay: Layout) -> dict:
    params = model_parameters(SHAPES[lay.size])
    total = {g: lay.gpu_bytes for gs in [lay.learner_gpus, *lay.producer_gpus] for g in gs}
    needs = plan(params, lay.setup, lay.learner_gpus, lay.producer_gpus, lay.engine_util,
                 total)
    worst = max(needs, key=lambda n: n.need)
    tp = len(lay.producer_gpus[0])
    weights = 2 * params  # bf16: what one version moves to every producer
    nodes = len({g.split(":")[0] for g in lay.learner_gpus})
    host = 16 * params / nodes if lay.setup.offload_optimizer else 0.0  # fp32 master + Adam
    return {
        "layout": lay.name,
        "params_b": round(params / 1e9, 2),
        "learner_bytes_per_param": round(bytes_per_param(lay.setup), 3),
        "learner_gb_per_gpu": round(max(n.learner for n in needs) / GB, 1),
        "engine_weights_gb_per_gpu": round(weights / tp / GB, 1),
        "worst_gpu_need_gb": round(worst.need / GB, 1),
        "host_gb_per_learner_node": round(host / GB),
        "gpu_gb": round(lay.gpu_bytes / GB, 1),
        "fits": all(n.need <= n.usable for n in needs),  # FREE_AT_PEAK of each GPU kept
        "sync_gb_per_version": round(weights / GB, 1),
        "sync_s_at_link": round(weights / GB / lay.link_gb_s, 2),
        "link_gb_s": lay.link_gb_s,
    }


def table(rows: list[dict]) -> str:
    head = ("| layout | params | learner B/param | learner GB/GPU | engine weights GB/GPU | "
            "worst GPU needs GB (of) | fits | host GB per learner node | GB per version | "
            "s per version at link |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['params_b']}B | {r['learner_bytes_per_param']} | "
                     f"{r['learner_gb_per_gpu']} | {r['engine_weights_gb_per_gpu']} | "
                     f"{r['worst_gpu_need_gb']} ({r['gpu_gb']}) | {'yes' if r['fits'] else 'no'}"
                     f" | {r['host_gb_per_learner_node']} | {r['sync_gb_per_version']} | "
                     f"{r['sync_s_at_link']} ({r['link_gb_s']:g} GB/s) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args(argv)
    rows = [row(lay) for lay in layouts()]
    print(table(rows))
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "layouts": [asdict(x) for x in layouts()]},
                                     indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
