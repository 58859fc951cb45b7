"""Synthetic arithmetic prompts: the example task whose reward a small instruct model can improve.

SmolLM2-135M-Instruct gets sums like "12 + 7" wrong often enough (it answers "9") that an exact-
match reward has room to rise, and right often enough that GRPO groups carry signal. The phrasing
is deliberately plain for a 135M model. Records are ``{"prompt_id", "prompt", "answer"}``; every
field other than prompt_id/prompt reaches the rewards as meta (``answer`` for exact_match).
Same (n, seed, max_operand, ops) -> same records.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def make_arithmetic_prompts(
    n: int, seed: int, max_operand: int = 20, ops: str = "+"
) -> list[dict[str, Any]]:
    """``n`` questions "What is A op B? Answer with just the number." with operands in
    [0, max_operand]. ``ops`` is a string of operators from "+-*"; subtraction keeps A >= B so
    every answer is a non-negative integer."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    if not ops or any(op not in _APPLY for op in ops):
        raise ValueError(f"ops must be a non-empty string of '+', '-', '*', got {ops!r}")
    rng = random.Random(seed)
    records = []
    for i in range(n):
        op = rng.choice(ops)
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if op == "-" and a < b:
            a, b = b, a
        records.append({
            "prompt_id": f"arith-{seed}-{i}",
            "prompt": f"What is {a} {op} {b}? Answer with just the number.",
            "answer": str(_APPLY[op](a, b)),
        })
    return records


def write_jsonl(path: Path | str, records: list[dict[str, Any]]) -> Path:
    """Write one JSON object per line (creating parent directories); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for rec in records:
            fh.write(json.dumps(rec) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.tasks.arithmetic",
        description="Write synthetic arithmetic prompts."
    )
    parser.add_argument("--n", type=int, default=2000, help="number of prompts")
    parser.add_argument("--out", type=Path, default=Path("data/arith.jsonl"), help="JSONL file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-operand", type=int, default=20)
    parser.add_argument("--ops", default="+", help="operators to draw from, e.g. '+-'")
    args = parser.parse_args(argv)
    records = make_arithmetic_prompts(args.n, args.seed, args.max_operand, args.ops)
    print(f"wrote {len(records)} prompts to {write_jsonl(args.out, records)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
