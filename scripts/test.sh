#!/usr/bin/env bash
# The README's second command (and what .ci/run calls): set up .venv, lint, run every test,
# including the real-vLLM end-to-end tests on the CPU build. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check .
# --durations=25: every run shows where the time goes (the budget: tests/time_budget.py).
# Two tests at once (pytest-xdist) on CI's two cores: they keep the cores about 86% busy; three
# were slower (BENCHMARKS.md, "Test suite duration"). tests/suite_order.py groups them (a file,
# or every Ray test, stays on one worker) and hands out the costliest groups first.
# TEST_WORKERS=0 runs everything in this one process.
workers=${TEST_WORKERS:-2}
xdist=()
if [ "$workers" != 0 ]; then
    xdist=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
fi
exec .venv/bin/pytest -p no:cacheprovider --durations=25 "${xdist[@]}" "$@"
