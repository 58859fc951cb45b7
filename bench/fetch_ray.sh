#!/usr/bin/env bash
# Ray for the GPU machine (Python 3.12, no network), for bench/run_gpu.sh's `ray` part: the
# ray 2.60.0 wheel without what a run never loads (Java jars, the dashboard's web client, the
# rllib/data/train/tune/serve/llm libraries), xz-compressed (~28 MB, under a call's 64 MiB
# beside the vLLM bundle's part b), plus the pure dependency wheels ray core imports.
# Run here, in the repo root; .gpu-bundle/ is git-ignored and travels with `carry`.
# On the GPU machine run_gpu.sh unpacks it into /tmp/site-ray, last on PYTHONPATH, so the
# machine's own packages win, and writes a `ray` command there (no pip: the wheel's console
# script is not made by unpacking).
set -euo pipefail
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 -d "$1" "${@:2}"; }
dl "$work/whl" ray==2.60.0
mkdir -p .gpu-bundle/ray/deps "$work/tree"
dl .gpu-bundle/ray/deps click filelock jsonschema jsonschema-specifications referencing rpds-py \
  attrs protobuf
# Unzip keeping each member's mode bits (gcs_server, raylet and the .so files are executables).
python3 - "$work"/whl/ray-*.whl "$work/tree" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for info in z.infolist():
        path = z.extract(info, sys.argv[2])
        mode = (info.external_attr >> 16) & 0o777
        if mode:
            os.chmod(path, mode)
PY
(cd "$work/tree/ray" && rm -rf jars dashboard/client rllib data train tune serve llm)
tar cf - -C "$work/tree" . | xz -T0 -6 > .gpu-bundle/ray/ray.tar.xz
du -sh .gpu-bundle/ray
