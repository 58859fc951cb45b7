#!/usr/bin/env bash
# Runs the GPU benchmarks and GPU tests on a GPU machine, one PART per call; every GPU figure in
# BENCHMARKS.md names the part (or the command inside it) that produced it.
#
# Usage, from the repository root, once vLLM is importable (on the lent GPU machine: after
# `source .gpu-bundle/b/activate.sh`, with .whl carried; CONTRIBUTING.md, "GPU machine"):
#   export CALL_T0=$(date +%s); bash bench/run_gpu.sh PART
#
# PART (GPUs it needs):
#   engine         producer vs offline LLM.generate, without and with logprobs (1 GPU);
#                  ABLATION=1 adds the five AsyncLLM request shapes
#   swap           weight-swap timings of the drain_prefill and wait barrier modes (1 GPU)
#   colocated      ours sync vs async1 vs TRL colocate, all on GPU 0 (1 GPU)
#   split          ours sync vs async1 (engine GPU 0, learner GPU 1) vs TRL server (2 GPUs)
#   trl-async      ours async1 vs TRL's AsyncGRPOTrainer (bench/trl_async.py: its vLLM server
#                  on GPU 0, its trainer on GPU 1, max_staleness 1), split layout, with TRL's
#                  logged MFU in the table (2 GPUs; MODEL=0.5b|1.5b|3b fit one call)
#   split-shared   ours sync vs async1, producers on GPUs 0 and 1, learner on GPU 1 (2 GPUs)
#   split-3x1      ours sync vs async1, producers on GPUs 0-2, learner on GPU 3 (4 GPUs; 15
#                  prompts per step, a multiple of 3)
#   scale          one call, three tables: split-3x1 (sync, async1), split (sync, async1) and
#                  split-tp2 (async1: one producer, tensor-parallel over GPUs 0-1, learner on
#                  GPU 2), all 15 prompts per step; left as scale.tgz (4 GPUs)
#   ray            the split layout through the local launcher and through --launcher ray, in
#                  one run (RUNS, default async1,ray-async1,sync,ray-sync) (2 GPUs; .gpu-bundle/ray
#                  from bench/fetch_ray.sh carried, or ray already unpacked on this machine)
#   prep           only the per-machine set-up the parts share (wheels, ray, the MODEL), so that
#                  parts can then run side by side on disjoint GPUs (GPUS) without racing on it
#   tp-test        the tensor-parallel GPU test: TP=2 engine on GPUs 0-1 takes each version by
#                  NCCL from a learner on GPU 2, checked by its logprobs (3 GPUs)
#   gpu-tests      gpu-marked tests: the split layout's NCCL route in pipeline-train (2 GPUs)
#   gpu-tests-learner  pipeline-train with ZeRO-3 and DDP learners, each run then resumed (2 GPUs;
#                  a call of its own: the two take 300-400 s)
#   gpu-tests-zero the ZeRO-2/3 trainer checks (2 GPUs; a call of their own)
#   reward         reward vs wall-clock of SmolLM2-135M, ours sync vs async1, colocated (1 GPU)
#   lora           bench.lora_sync, rank 16 on the 0.5B model with CUDA graphs: generation tok/s
#                  of an adapter version vs merged weights (and their ratio), bytes and swap
#                  time per version (1 GPU; peft from .whl, bench/fetch_wheels.sh)
#   one-card       one 80 GB card, colocated: ours async1 at each of MODELS (default "1.5b 3b
#                  7b-lora 0.5b"; SIZE-lora = LoRA rank 16) with the memory plan choosing every
#                  memory option and the engine share; TRL=1 adds TRL colocate beside each; a
#                  table of samples/s, MFU, the card's NVML peak and the learner's against the
#                  plan's predictions (bench.one_card), one-card-logs.tgz (1 GPU)
#   checkpoint     the disk and /dev/shm by dd; bench.checkpoint_bench at 3B (CKPT_MODEL) writing
#                  under /dev/shm (CKPT_DIR; /tmp if /dev/shm has under 45 GB free), one
#                  checkpoint at a time: stall and write GB/s vs one torch.save stream; then ours
#                  async1 colocated at RUN_MODEL (default 1.5b) without and with
#                  train.checkpoint_every=1 (keep_checkpoints 1, run dirs there too), the ratio
#                  and stalls by bench.checkpoint_runs (1 GPU); CKPT_BENCH=0 leaves the bench
#                  out, LAYOUT=split runs the pair on the split layout (2 GPUs: a 3B pair,
#                  whose staging and checkpoints need more host memory than one-GPU machines')
#   learner7b      the learner alone over 2 GPUs, no engines (bench.learner_bench --processes 2,
#                  MODEL default 7b, drawn at random on the GPUs): every variant of its
#                  DIST_DEFAULT (or VARIANTS=a,b,...) in a fresh process group, in that order,
#                  sharing the call: ZeRO-3 as the 7B run uses it, packed and checkpointed,
#                  larger ZeRO prefetch/buckets, FSDP2, ZeRO-3 with fp32 weights; s/step,
#                  tokens/s, MFU, peak memory per rank; RUN_TIMEOUT caps one variant (150 s),
#                  STEPS timed steps (2), BENCH_ARGS more learner_bench flags (2 GPUs;
#                  deepspeed from .whl)
#
# Environment:
#   MODEL=0.5b|1.5b|3b|7b  random-init model of colocated/split/trl-async (default 0.5b;
#                     bench/gpu_model.py: Qwen2-0.5B/1.5B, Qwen2.5-3B/7B shapes, drawn in bf16
#                     on the GPU and written straight to safetensors)
#   GPUS              the machine's GPU ids the part's GPUs 0, 1, ... are (gpu_bench --gpus), e.g.
#                     GPUS=0,1 bash bench/run_gpu.sh split & GPUS=2,3 bash bench/run_gpu.sh ray &
#                     wait  (run `prep` first; two parts side by side leave at most 8 files)
#   STEPS             learner steps per run (default 8; 60 for reward)
#   RUNS              our runs of colocated (default sync,async1; sync-sleep adds sync with
#                     engine.sleep_when_idle)
#   ROUTE             sync.route of our runs (default auto: ipc colocated, nccl split)
#   RUN_TIMEOUT       seconds per run; CALL_BUDGET seconds for the whole call (default 570)
#   CALL_T0           when the call began (epoch seconds); timed parts share CALL_BUDGET from
#                     then, leaving 30 s of a 600 s call for cutting runs short and packing.
#                     Without it the budget counts from this script's start.
#   OUT               where results go (default runs/gpu)
# Our runs use CUDA graphs (engine.enforce_eager=false), as TRL's vLLM does by default.
# Wheels found in .whl/ (bench/fetch_wheels.sh: trl, deepspeed, uvicorn, ...) are installed into
# /tmp/site once per machine.
#
# Output: each benchmark part prints its Markdown table and leaves under $OUT only
# results.{md,json,png}, PART-logs.tgz (every log, config and metrics file of its runs) and what
# fits of NAME.metrics.jsonl, since the GPU machine returns at most 8 files per call.
#
# Part `reward` needs SmolLM2-135M-Instruct, which no hub serves on the GPU machine: its GGUF
# travels xz-compressed in two parts (bench/stage_model.sh). Here, once:
#   bash bench/fetch_wheels.sh        # adds the gguf wheel
#   bash bench/stage_model.sh split   # writes .gpu-model/m1 and m2, checks each call's size
# Then three calls on one machine, back to back (it stays warm about 30 s after a call):
#   1. carrying .gpu-bundle/a:     bash .gpu-bundle/a/stage.sh
#   2. carrying .gpu-model/m1:     bash bench/stage_model.sh put .gpu-model/m1
#   3. carrying .gpu-bundle/b, .whl and .gpu-model/m2, with a 600 s limit:
#        export CALL_T0=$(date +%s); source .gpu-bundle/b/activate.sh && bash bench/run_gpu.sh reward
# Call 3 parks m2, joins and checks the GGUF (sha256 of each part and of the whole), converts it
# with pipeline/models.py into /tmp/smollm2 (about 30 s), then trains it with the demo's recipe
# (examples/demo.yaml: sums of 0..9, exact match, lr 5e-5, freeze_layers 20, <= 16 tokens, not
# ignore_eos) at 16 prompts x 8 completions per step, once per mode. The two runs share what is
# left of the call equally, so a slow run is cut at the same wall-clock as the other; time to
# reward is read from the steps logged either way. Engines run eager here (EAGER=false for CUDA
# graphs): short answers make generation a small part of a step, and eager saves the compile.
# A later call on the same warm machine needs only .gpu-bundle/b and .whl (the model is kept).
set -uo pipefail
out=${OUT:-runs/gpu}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then  # once per machine and per set of wheels
  stamp=/tmp/site/.whl-$(ls .whl | md5sum | cut -c1-8)
  [ -f "$stamp" ] || { python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
    --target /tmp/site .whl/*.whl && touch "$stamp"; }
fi
if [ -f .gpu-bundle/ray/ray.tar.xz ] && [ ! -f /tmp/site-ray/.ok ]; then  # once per machine
  mkdir -p /tmp/site-ray/bin && xz -dc .gpu-bundle/ray/ray.tar.xz | tar xf - -C /tmp/site-ray
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-ray \
    .gpu-bundle/ray/deps/*.whl
  printf '#!/usr/bin/env python3\nimport sys\nfrom ray.scripts.scripts import main\nsys.exit(main())\n' \
    >/tmp/site-ray/bin/ray && chmod +x /tmp/site-ray/bin/ray && touch /tmp/site-ray/.ok
fi
if [ -f /tmp/site-ray/.ok ]; then  # last on the path: the machine's own packages win
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site-ray PATH=/tmp/site-ray/bin:$PATH
fi
q05() { [ -f /tmp/q05/config.json ] || python3 -m bench.gpu_model /tmp/q05; }
quiet() { grep -v -E "^(INFO|DEBUG)|it/s\]|Loading safetensors|EngineCore" ; }
steps=${STEPS:-8}
common=(--model "${MODEL:-0.5b}" --steps "$steps" --set engine.enforce_eager=false
        --set "sync.route=${ROUTE:-auto}" ${GPUS:+--gpus "$GPUS"})
call_t0=${CALL_T0:-$(date +%s)}  # no guess from the parent process: it may be a long-lived runner
# Seconds left of CALL_BUDGET since the call began.
left() { echo $(( ${CALL_BUDGET:-570} - $(date +%s) + call_t0 )); }
# The smaller of $1 and what is left; fails (the part stops) under 60 s.
budget() {
  local t; t=$(left); [ "$t" -le "$1" ] || t=$1
  [ "$t" -ge 60 ] || { echo "run_gpu.sh: only $(left) s left in this call" >&2; return 1; }
  echo "$t"
}
# pytest under a time limit, its log in $out/NAME.log; a failed or cut run fails the part (exit).
failed=()
gpu_tests() {  # $1: seconds, $2: NAME, then pytest's arguments
  timeout -k 10 "$1" python3 -m pytest -v -p no:cacheprovider -m gpu "${@:3}" 2>&1 \
    | tee "$out/$2.log" | quiet
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] && return 0
  [ "$rc" = 124 ] && echo "run_gpu.sh: gpu tests '$2' cut at $1 s" >&2 \
    || echo "run_gpu.sh: gpu tests '$2' exited $rc" >&2
  failed+=("$2")
}
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
  lora)
    q05
    timeout 500 python3 -m bench.lora_sync --model /tmp/q05 --rank 16 --versions 3 --seqs 256 \
      --gen-tokens 128 --cuda-graphs 2>&1 | tee "$out/lora.log" | quiet
    ;;
  swap)
    q05
    timeout 240 python3 -m bench.sync_bench --model /tmp/q05 --requests 128 --swaps 3 --max-tokens 256 \
      --modes drain_prefill,wait --max-num-batched-tokens 0 2>&1 | tee "$out/sync.log" | quiet
    ;;
  colocated)
    run_bench colocated --layout colocated "${common[@]}" --runs "${RUNS:-sync,async1}" --trl colocate \
      --gpu-mem 0.35 --run-timeout "${RUN_TIMEOUT:-190}"
    ;;
  split)
    run_bench split --layout split "${common[@]}" --runs sync,async1 --trl server --gpu-mem 0.6 \
      --run-timeout "${RUN_TIMEOUT:-190}"
    ;;
  trl-async)
    # What TRL's async path imports beyond its server mode (aiohttp: the rollout worker's HTTP
    # client; requests: its server client), checked before any GPU time is spent.
    python3 -c "import aiohttp, requests, trl; print('trl', trl.__version__)" || exit 1
    run_bench trl-async --layout split "${common[@]}" --runs async1 --trl async --gpu-mem 0.6 \
      --run-timeout "${RUN_TIMEOUT:-240}"
    ;;
  split-shared|split-3x1)  # 2 GPUs (a producer beside the learner) | 4 GPUs (3 producers)
    groups=$([ "$1" = split-3x1 ] && echo 15 || echo 16)
    run_bench "$1" --layout "$1" "${common[@]}" --runs sync,async1 --batch-groups "$groups" \
      --gpu-mem 0.4 --run-timeout "${RUN_TIMEOUT:-240}"
    ;;
  scale)  # the three layouts back to back; their folders leave as one file
    for layout in split-3x1 split split-tp2; do
      runs=$([ "$layout" = split-tp2 ] && echo async1 || echo sync,async1)
      run_bench "scale-$layout" --layout "$layout" "${common[@]}" --runs "$runs" \
        --batch-groups 15 --gpu-mem 0.4 --run-timeout "${RUN_TIMEOUT:-240}" || break
    done
    (cd "$out" && tar czf scale.tgz scale-split-3x1 scale-split scale-split-tp2 2>/dev/null
     rm -rf scale-split-3x1 scale-split scale-split-tp2)
    ;;
  ray)
    python3 -c "import ray; print('ray', ray.__version__)" || exit 1
    run_bench ray --layout split "${common[@]}" --runs "${RUNS:-async1,ray-async1,sync,ray-sync}" \
      --gpu-mem 0.6 --run-timeout "${RUN_TIMEOUT:-190}"
    ;;
  prep)
    python3 -c "from pathlib import Path; from bench.gpu_bench import prepare_model as p
for m in '${MODEL:-0.5b}'.split(','): print(p(m, Path('/tmp/bench-models')))"
    python3 -c "import ray; print('ray', ray.__version__)" 2>/dev/null || echo "no ray here"
    ;;
  tp-test)
    t=$(budget 300) && gpu_tests "$t" tp tests/e2e/test_gpu_tp.py
    ;;
  gpu-tests)
    # (the colocated run with the engine asleep is a 1-GPU known failure: not in this 2-GPU part)
    t=$(budget 400) && gpu_tests "$t" split tests/e2e/test_gpu_transports.py \
      -k "pipeline_train and not asleep"
    ;;
  gpu-tests-learner)
    t=$(budget 540) && gpu_tests "$t" learner tests/e2e/test_gpu_deepspeed.py \
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
      --set "sync.route=${ROUTE:-auto}" --run-timeout "$run_to" ${BENCH_ARGS:-}
    ;;
  learner7b)
    python3 -c "import accelerate, deepspeed, msgspec; print('deepspeed', deepspeed.__version__)" \
      || exit 1
    t=$(budget 600) || exit 1
    echo "learner7b: $t s for learner_bench"
    # BENCH_ARGS word-split on purpose (e.g. the CPU check: --batch 2 --max-tokens 16).
    CUDA_VISIBLE_DEVICES=${GPUS:-${CUDA_VISIBLE_DEVICES:-0,1}} timeout -k 15 "$t" \
      python3 -m bench.learner_bench --size "${MODEL:-7b}" --processes 2 \
      ${VARIANTS:+--variants "$VARIANTS"} --steps "${STEPS:-2}" --budget $(( t - 20 )) \
      --variant-timeout "${RUN_TIMEOUT:-150}" --out "$out/learner7b" ${BENCH_ARGS:-} 2>&1 | quiet
    pack learner7b
    ;;
  checkpoint)
    df -h /dev/shm /tmp . | sed 's/^/df: /'
    for d in /dev/shm /tmp; do  # 4 GB, fsynced: what a write of a checkpoint can reach there
      echo "dd $d: $(dd if=/dev/zero of=$d/ckpt-dd.bin bs=16M count=256 conv=fsync 2>&1 | tail -1)"
      rm -f "$d/ckpt-dd.bin"
    done
    # Checkpoints go to /dev/shm when it holds one 3B checkpoint and change (45 GB), else /tmp.
    ckdir=${CKPT_DIR:-$( [ "$(df -B1 --output=avail /dev/shm | tail -1)" -ge 45000000000 ] \
      && echo /dev/shm || echo /tmp)}
    echo "checkpoint: writing under $ckdir"
    if [ "${CKPT_BENCH:-1}" = 1 ]; then
      t=$(budget 210) || exit 1
      timeout -k 10 "$t" python3 -m bench.checkpoint_bench --model "${CKPT_MODEL:-3b}" \
        --device cuda --dir "$ckdir" --saves 3 2>&1 | tee "$out/checkpoint-bench.log" | quiet
    fi
    left=$(left)
    run_to=$(( (left - 30) / 2 ))
    [ "$run_to" -le "${RUN_TIMEOUT:-190}" ] || run_to=${RUN_TIMEOUT:-190}
    [ "$run_to" -ge 60 ] || { echo "checkpoint: only $left s left for the runs" >&2; exit 1; }
    runs=$ckdir/ckpt-runs
    rm -rf "$runs"
    for v in none every1; do
      extra=(); [ "$v" = none ] || extra=(--set train.checkpoint_every=1 --set train.keep_checkpoints=1)
      timeout -k 15 "$run_to" python3 -m bench.gpu_bench --out "$runs/$v" --layout "${LAYOUT:-colocated}" \
        --model "${RUN_MODEL:-1.5b}" --steps "$steps" --set engine.enforce_eager=false \
        --set "sync.route=${ROUTE:-auto}" --runs async1 --gpu-mem 0.35 \
        --set train.packing=true --run-timeout "$run_to" "${extra[@]}" 2>&1 | quiet
    done
    python3 -m bench.checkpoint_runs "$runs/none" "$runs/every1" | tee "$out/checkpoint-runs.md"
    mkdir -p "$out/checkpoint"
    for v in none every1; do
      cp "$runs/$v/results.md" "$out/checkpoint/$v.results.md" 2>/dev/null
      find "$runs/$v" -name checkpoints -prune -o -name snapshots -prune -o -type f \
        \( -name '*.log' -o -name '*.jsonl' -o -name '*.yaml' \) -print
    done | tar czf "$out/checkpoint/checkpoint-logs.tgz" -T - 2>/dev/null
    rm -rf "$runs"
    ;;
  one-card)
    # MODELS: SIZE or SIZE-lora (LoRA rank 16), in order; each is ours async1 colocated on GPU 0
    # with the engine share and every memory option left to the memory plan, and with TRL=1
    # TRL colocate beside it (gradient checkpointing from 1.5B up, peft LoRA for -lora). Each
    # model gets an equal share of what is left of the call.
    models=(${MODELS:-1.5b 3b 7b-lora 0.5b})
    models=(${models[@]//,/ })
    for i in "${!models[@]}"; do
      m=${models[$i]} size=${models[$i]%-lora} ours=() trl=()
      [ "$m" = "$size" ] || { ours=(--set train.lora_rank=16); trl=(--trl-arg=--lora-rank=16); }
      [ "$size" = 0.5b ] || trl+=(--trl-arg=--gradient-checkpointing)
      t=$(( ($(left) - 20) / (${#models[@]} - i) ))
      [ "$t" -ge 90 ] || { echo "one-card: $(left) s left, not enough for $m" >&2; break; }
      runs=$([ -n "${TRL:-}" ] && echo 2 || echo 1)
      echo "one-card: $m, $t s"
      timeout -k 15 "$t" python3 -m bench.gpu_bench --out "$out/one-card/$m" --layout colocated \
        --model "$size" --steps "$steps" --set engine.enforce_eager=false \
        --set "sync.route=${ROUTE:-auto}" --runs async1 ${TRL:+--trl colocate} "${trl[@]}" \
        --gpu-mem 0.3 --run-timeout $(( (t - 10) / runs )) "${ours[@]}" 2>&1 | quiet
    done
    python3 -m bench.one_card "$out/one-card" --json "$out/one-card.json" | tee "$out/one-card.md"
    (cd "$out/one-card" && find . \( -name checkpoints -o -name snapshots -o -name producers \
      -o -name tb -o -name tensorboard \) -prune -o -type f \( -name '*.log' -o -name '*.jsonl' \
      -o -name '*.json' -o -name '*.yaml' -o -name '*.md' \) -print | tar czf ../one-card-logs.tgz -T -)
    rm -rf "$out/one-card"
    ;;
  *) echo "unknown part $1" >&2; exit 2 ;;
esac
# Run dirs hold checkpoints and sockets the device tool cannot return; keep the small files.
find "$out" -mindepth 2 \( -name checkpoints -o -name producers -o -name snapshots \) -prune \
  -exec rm -rf {} + 2>/dev/null || true
[ ${#failed[@]} = 0 ] || { echo "run_gpu.sh: failed: ${failed[*]}" >&2; exit 1; }
