"""What ``pipeline-train`` checks before any process starts (every launcher and the eval
subcommand): model, data, rewards, episode function, vLLM and tracker versions, the memory plan,
free disk for the checkpoints and the bind addresses. A problem is a ``ConfigError``: one line
naming the option, exit 2."""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.config import RunConfig
from pipeline.keys import curve_keys
from pipeline.options import ConfigError

log = logging.getLogger("pipeline")


def prepare(cfg: RunConfig, role: str = "all") -> str:
    """Fail fast, before any process starts: model, data and rewards must all resolve. Every
    check that needs no model runs before the model is resolved, which may build or convert it
    (a minute and a progress bar that a mistyped --data should not cost)."""
    from pipeline.models import resolve_model
    from pipeline.producer.data import check_data, check_records, load_records
    from pipeline.producer.rewards.loading import validate_specs

    conversational = check_records(cfg.data, load_records(cfg.data.path))
    try:
        validate_specs(cfg.rewards.specs)
    except (ImportError, ValueError, AttributeError, TypeError) as e:
        raise ConfigError(f"rewards.specs: {e}") from None
    if cfg.episode.fn and role in ("all", "producer"):
        from pipeline.producer.episode import load_episode

        try:
            load_episode(cfg.episode.fn)
        except ValueError as e:
            raise ConfigError(f"episode.fn: {e}") from None
    if role in ("all", "producer"):
        check_installed_vllm(cfg.engine.allow_untested_vllm)
        from pipeline.producer.engine import EngineSetupError, check_extra
        from pipeline.producer.trained_sampling import UntrainableSampling, distribution

        g = cfg.generation
        try:
            check_extra(cfg.engine.extra)
            distribution({"temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k})
        except (EngineSetupError, UntrainableSampling) as e:
            raise ConfigError(str(e)) from None
    if role in ("all", "learner"):
        check_trackers(cfg.report_to)
    _check_bind_addrs(cfg, role)
    # Then what needs the model: its tokenizer, its size.
    try:
        model_path = str(resolve_model(cfg.model.path, Path(cfg.model.cache_dir)))
    except ValueError as e:
        raise ConfigError(f"model.path: {e}") from None
    if conversational:  # the tokenizer must have a chat template to render the prompts
        check_data(cfg.data, model_path)
    if role == "all" and cfg.launch.backend == "local":  # Ray places the processes itself
        from pipeline.memory import MemoryPlanError, check_memory_plan

        try:
            check_memory_plan(cfg, model_path)
        except MemoryPlanError as e:
            raise ConfigError(f"launch.memory_check: {e}") from None
    if role in ("all", "learner"):
        from pipeline.learner.disk import check_run_space

        short = check_run_space(cfg, model_path)  # before a full disk ends the run mid-way
        if short:
            raise ConfigError(short)
    return model_path


def _check_bind_addrs(cfg: RunConfig, role: str) -> None:
    """The learner's addresses can be bound (the learner would refuse producers only after
    their engines had started); the CURVE keys are made here, before any child starts, so a
    single-host run's producers find them."""
    from buffer.transport import check_bind_addr

    curve = curve_keys(cfg, "learner" if role in ("all", "learner") else "producer")
    if role not in ("all", "learner"):  # producers connect; only the learner binds
        return
    for option, addr in (("addr", cfg.bind_addr), ("sync.serve_stream", cfg.sync.serve_stream)):
        try:
            if addr:
                check_bind_addr(addr, curve, cfg.insecure)
        except ValueError as e:
            raise ConfigError(f"{option}: {e}") from None


def check_installed_vllm(allow_untested: bool) -> None:
    """Refuse a vLLM known to break, or an untested one without the flag, before any engine
    starts (one line, exit 2); warn once for an allowed untested one."""
    from pipeline.producer.vllm_version import (
        VllmVersionError,
        check_vllm_version,
        installed_vllm_version,
    )

    version = installed_vllm_version()
    if version is None:
        return  # the producer reports a missing vLLM itself
    try:
        warning = check_vllm_version(version, allow_untested)
    except VllmVersionError as e:
        raise ConfigError(f"engine.allow_untested_vllm: {e}") from None
    if warning:
        log.warning("%s", warning)


def check_trackers(report_to: list[str]) -> None:
    """Every tracker named in report_to is installed (checked without importing it)."""
    from pipeline.learner import trackers

    missing = trackers.missing_packages(report_to)
    if missing:
        raise ConfigError(f"report_to: {', '.join(missing)} named but not installed "
                          f"(pip install {' '.join(missing)}, or pip install -e .[trackers])")
