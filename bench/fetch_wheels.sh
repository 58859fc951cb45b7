#!/usr/bin/env bash
# Wheels the GPU machine lacks for bench/run_gpu.sh (no network there): TRL and what its
# `vllm serve` path imports that the trimmed vLLM bundle leaves out, and DeepSpeed (pure Python,
# no compiled ops), and gguf (pure Python; numpy, pyyaml, requests, tqdm are on the machine) for
# converting the carried SmolLM2 GGUF there (bench/stage_model.sh). Run here, in the repo root;
# .whl/ is git-ignored and travels with `carry`.
# TRL's AsyncGRPOTrainer (bench/trl_async.py, part trl-async) needs no wheel beyond these: its
# other imports are on the machine already (accelerate, transformers 5.17; aiohttp and requests,
# which `vllm serve` and TRL's server mode import there; numpy, pandas, pyarrow for datasets), and
# the one thing it fetches at run time, the FA3 kernel of the `kernels` package from the Hub,
# cannot reach the machine at all: bench/trl_async.py puts torch's varlen attention in its place.
# run_gpu.sh trl-async checks `import aiohttp, requests, trl` before spending GPU time.
set -euo pipefail
mkdir -p .whl
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "$@"; }
dl trl==1.16.0 datasets==4.8.5 multiprocess==0.70.19 hjson==3.1.0 \
  uvicorn==0.54.0 watchfiles==1.3.0 model_hosting_container_standards==0.1.16 jmespath==1.1.0 \
  prometheus_fastapi_instrumentator==8.1.0 gguf==0.19.0
dl peft==0.21.2  # pure Python: the LoRA learner of bench.lora_sync (run_gpu.sh lora)
[ -n "$(ls .whl/deepspeed-0.19.8-*.whl 2>/dev/null)" ] || DS_BUILD_OPS=0 .venv/bin/python -m pip \
  wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
ls -la .whl
