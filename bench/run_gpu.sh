#!/usr/bin/env bash
# The GPU measurements quoted in README/BENCHMARKS, one part per device call (each < 10 min).
# On the device, after `source .gpu-bundle/b/activate.sh` (with .whl carried for trl/deepspeed):
#   bash bench/run_gpu.sh PART
# PART: engine    - producer vs offline throughput, then swap timings per barrier mode (1 GPU)
#       colocated - ours sync vs async1 vs TRL colocate, all on GPU 0 (1 GPU)
#       split     - ours sync vs async1 (engine GPU 0, learner GPU 1) vs TRL server (2 GPUs)
#       gpu-tests - gpu-marked tests: nccl transport, DeepSpeed ZeRO-2 (2 GPUs; ipc: 1 GPU)
# Our runs use CUDA graphs (engine.enforce_eager=false), as TRL's vLLM does by default.
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
common=(--model /tmp/q05 --steps "$steps" --set engine.enforce_eager=false)
case "${1:?part}" in
  engine)
    timeout 330 python3 -m pipeline.bench_producer --model /tmp/q05 --prompts 256 \
      --group-size 8 --max-tokens 256 --streams final --ablation 2>&1 | tee "$out/producer.log" | quiet
    timeout 240 python3 -m sync.bench --model /tmp/q05 --requests 128 --swaps 3 --max-tokens 256 \
      --modes drain_prefill,wait --max-num-batched-tokens 0 2>&1 | tee "$out/sync.log" | quiet
    ;;
  colocated)
    timeout 580 python3 -m bench.gpu_bench --layout colocated "${common[@]}" --runs sync,async1 \
      --trl colocate --gpu-mem 0.35 --set sync.transport=file --out "$out/colocated" \
      --run-timeout 190 2>&1 | quiet
    ;;
  split)
    timeout "${PART_TIMEOUT:-590}" python3 -m bench.gpu_bench --layout split "${common[@]}" --runs sync,async1 \
      --trl server --gpu-mem 0.6 --set sync.transport=file --out "$out/split" \
      --run-timeout "${RUN_TIMEOUT:-190}" 2>&1 | quiet
    ;;
  gpu-tests)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -x -m gpu \
      tests/e2e/test_gpu_transports.py -k nccl 2>&1 | tee "$out/transports.log" | quiet
    timeout 300 python3 -m pytest -q -p no:cacheprovider -x -m gpu \
      tests/e2e/test_gpu_deepspeed.py -k "zero_two_gpus and zero2" 2>&1 | tee "$out/deepspeed.log" \
      | quiet
    ;;
  *) echo "unknown part $1" >&2; exit 2 ;;
esac
# Run dirs hold checkpoints and sockets the device tool cannot return; keep the small files.
find "$out" -mindepth 2 \( -name checkpoints -o -name producers -o -name snapshots \) -prune \
  -exec rm -rf {} + 2>/dev/null || true
