#!/usr/bin/env bash
# The README's second command (and what .ci/run calls): set up .venv, lint, run every test,
# including the real-vLLM end-to-end tests on the CPU build. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check .
# --durations=25: every run shows where the time goes (the budget: tests/time_budget.py).
exec .venv/bin/pytest -p no:cacheprovider --durations=25 "$@"
