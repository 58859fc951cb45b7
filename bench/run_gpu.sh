#!/usr/bin/env bash
# The GPU measurements quoted in README/BENCHMARKS, one part per device call (each < 10 min).
# On the device, after `source .gpu-bundle/b/activate.sh`:  bash bench/run_gpu.sh PART
# PART: engine   - producer vs offline throughput, then swap timings per barrier mode (1 GPU)
#       colocated - ours sync vs async, learner and engine sharing GPU 0 (1 GPU)
#       split     - ours sync vs async1/async2, engine on GPU 0, learner on GPU 1 (2 GPUs)
#       trl       - TRL GRPOTrainer colocate + server on the same job (2 GPUs)
# Logs and tables go to $OUT (the device tool's return folder) or runs/gpu.
set -uo pipefail
out=${OUT:-runs/gpu}
mkdir -p "$out"
[ -f /tmp/q05/config.json ] || python3 -m sync.gpu_model /tmp/q05
quiet() { grep -v -E "^(INFO|DEBUG)|it/s\]|Loading safetensors" ; }
steps=${STEPS:-10}
case "${1:?part}" in
  engine)
    timeout 330 python3 -m pipeline.bench_producer --model /tmp/q05 --prompts 256 \
      --group-size 8 --max-tokens 256 --streams final --ablation 2>&1 | tee "$out/producer.log" | quiet
    timeout 240 python3 -m sync.bench --model /tmp/q05 --requests 128 --swaps 3 --max-tokens 256 \
      --modes drain_prefill,wait --max-num-batched-tokens 0 2>&1 | tee "$out/sync.log" | quiet
    ;;
  colocated)
    timeout 560 python3 -m bench.gpu_bench --layout colocated --model /tmp/q05 --steps "$steps" \
      --runs sync,async1 --gpu-mem 0.35 --out "$out/colocated" --run-timeout 270 2>&1 | quiet
    ;;
  split)
    timeout 580 python3 -m bench.gpu_bench --layout split --model /tmp/q05 --steps "$steps" \
      --runs sync,async1,async2 --gpu-mem 0.6 --out "$out/split" --run-timeout 190 2>&1 | quiet
    ;;
  trl)
    timeout 580 python3 -m bench.gpu_bench --layout split --model /tmp/q05 --steps "$steps" \
      --runs "" --trl colocate,server --out "$out/trl" --run-timeout 280 2>&1 | quiet
    ;;
  *) echo "unknown part $1" >&2; exit 2 ;;
esac
