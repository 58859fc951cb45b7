#!/usr/bin/env bash
# The GPU measurements quoted in README/BENCHMARKS, one part per device call (each < 10 min).
# On the device, after `source .gpu-bundle/b/activate.sh` (with .whl carried for trl/deepspeed):
#   bash bench/run_gpu.sh PART
# PART: engine    - producer vs offline throughput, with AsyncLLM ablations (1 GPU)
#       swap      - weight-swap timings per barrier mode (sync.bench, 1 GPU)
#       colocated - ours sync vs async1 vs TRL colocate, all on GPU 0 (1 GPU)
#       split     - ours sync vs async1 (engine GPU 0, learner GPU 1) vs TRL server (2 GPUs)
#       gpu-tests - gpu-marked tests on 2 GPUs: the split layout's NCCL route in pipeline-train,
#                   ZeRO-2/3 trainer checks, pipeline-train with ZeRO-3 and DDP learners
# Our runs use CUDA graphs (engine.enforce_eager=false), as TRL's vLLM does by default, and
# sync.transport=$TRANSPORT (default auto: ipc colocated, nccl split). MODEL=0.5b|1.5b (default
# 0.5b) picks the random-init model of colocated/split; STEPS their learner steps (default 8).
# Logs and tables go to $OUT (the device tool's return folder) or runs/gpu.
set -uo pipefail
out=${OUT:-runs/gpu}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then  # once per machine and per set of wheels
  stamp=/tmp/site/.whl-$(ls .whl | md5sum | cut -c1-8)
  [ -f "$stamp" ] || { python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
    --target /tmp/site .whl/*.whl && touch "$stamp"; }
fi
[ -f /tmp/q05/config.json ] || python3 -m sync.gpu_model /tmp/q05
quiet() { grep -v -E "^(INFO|DEBUG)|it/s\]|Loading safetensors|EngineCore" ; }
steps=${STEPS:-8}
common=(--model "${MODEL:-0.5b}" --steps "$steps" --set engine.enforce_eager=false
        --set "sync.transport=${TRANSPORT:-auto}")
gpu_tests() { timeout "$1" python3 -m pytest -v -p no:cacheprovider -m gpu "${@:3}" 2>&1 \
  | tee "$out/$2.log" | quiet; }
case "${1:?part}" in
  engine)
    timeout 330 python3 -m pipeline.bench_producer --model /tmp/q05 --prompts 256 \
      --group-size 8 --max-tokens 256 --streams final --ablation 2>&1 | tee "$out/producer.log" | quiet
    ;;
  swap)
    timeout 240 python3 -m sync.bench --model /tmp/q05 --requests 128 --swaps 3 --max-tokens 256 \
      --modes drain_prefill,wait --max-num-batched-tokens 0 2>&1 | tee "$out/sync.log" | quiet
    ;;
  colocated)
    timeout 580 python3 -m bench.gpu_bench --layout colocated "${common[@]}" --runs sync,async1 \
      --trl colocate --gpu-mem 0.35 --out "$out/colocated" \
      --run-timeout 190 2>&1 | quiet
    ;;
  split)
    timeout "${PART_TIMEOUT:-590}" python3 -m bench.gpu_bench --layout split "${common[@]}" --runs sync,async1 \
      --trl server --gpu-mem 0.6 --out "$out/split" \
      --run-timeout "${RUN_TIMEOUT:-190}" 2>&1 | quiet
    ;;
  gpu-tests)
    gpu_tests 120 split tests/e2e/test_gpu_transports.py -k pipeline_train
    gpu_tests 330 pipeline tests/e2e/test_gpu_deepspeed.py -k "pipeline_train and auto"
    gpu_tests 130 zero tests/e2e/test_gpu_deepspeed.py -k "zero_two_gpus and not offload"
    ;;
  *) echo "unknown part $1" >&2; exit 2 ;;
esac
# Run dirs hold checkpoints and sockets the device tool cannot return; keep the small files.
find "$out" -mindepth 2 \( -name checkpoints -o -name producers -o -name snapshots \) -prune \
  -exec rm -rf {} + 2>/dev/null || true
