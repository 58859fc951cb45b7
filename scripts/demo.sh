#!/usr/bin/env bash
# The README's first command: set up .venv (idempotent) and run the main job, a real GRPO run
# of SmolLM2-135M-Instruct on synthetic sums with vLLM's CPU build (~10 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/pipeline-train --config examples/demo.yaml "$@"
