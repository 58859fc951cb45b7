"""The producer benchmark (issue: producer throughput next to offline ``LLM.generate``, same
prompts, same run) end to end on the CPU build of vLLM with the tiny model: every reference and
ablation line is printed with a positive rate, and the producer's ratio to each reference."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_bench_producer_prints_rates_and_ratios(tiny_model, tmp_path):
    cmd = [sys.executable, "-m", "bench.producer", "--model", str(tiny_model),
           "--prompts", "8", "--group-size", "2", "--max-tokens", "8", "--streams", "final",
           "--offline-logprobs", "--ablation"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("[bench_producer]")]
    rates = {x.split(":")[0]: float(re.search(r"= (\d+) tok/s", x).group(1))
             for x in lines if "tok/s" in x}
    assert len(rates) == 2 + 5 + 1, lines  # 2 offline references, 5 ablations, the producer
    assert all(r > 0 for r in rates.values()), rates
    ratios = re.findall(r"ratio producer/(offline\+logprobs|offline) = ([\d.]+)", proc.stdout)
    assert [name for name, _ in ratios] == ["offline", "offline+logprobs"], proc.stdout
    assert all(float(v) > 0 for _, v in ratios)
    # 8 prompts x 2 completions x 8 tokens (ignore_eos) everywhere
    assert proc.stdout.count("128 tokens in") == 8, proc.stdout
