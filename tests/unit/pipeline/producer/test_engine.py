"""pipeline.producer.engine: engine arguments and version checks (pure; no engine started)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from pipeline.config import EngineConfig, ModelConfig
from pipeline.producer.engine import (
    WORKER_EXTENSION,
    EngineSetupError,
    cpu_cores,
    engine_kwargs,
)


@dataclass
class _Cap:
    major: int
    minor: int

    def to_int(self) -> int:
        return self.major * 10 + self.minor

    def as_version_str(self) -> str:
        return f"{self.major}.{self.minor}"


class _FakePlatform:
    """The two methods of vLLM's current_platform that engine_kwargs uses."""

    def __init__(self, cpu: bool = False, cap: tuple[int, int] | None = (9, 0)):
        self._cpu, self._cap = cpu, cap

    def is_cpu(self) -> bool:
        return self._cpu

    def get_device_capability(self):
        return None if self._cap is None else _Cap(*self._cap)


CPU = _FakePlatform(cpu=True)


def _kw(platform=CPU, model=None, **eng):
    return engine_kwargs(model or ModelConfig(), EngineConfig(**eng), "/m", 7, platform)


def test_passes_options_through():
    kw = _kw(
        enable_prefix_caching=True,
        enable_chunked_prefill=False,
        max_num_seqs=32,
        max_num_batched_tokens=4096,
        max_model_len=512,
        extra={"swap_space": 1},
    )
    assert kw["enable_prefix_caching"] is True
    assert kw["enable_chunked_prefill"] is False
    assert kw["max_num_seqs"] == 32
    assert kw["max_num_batched_tokens"] == 4096
    assert kw["max_model_len"] == 512
    assert kw["swap_space"] == 1
    assert kw["model"] == "/m" and kw["seed"] == 7
    assert kw["worker_extension_cls"] == WORKER_EXTENSION


def test_unset_options_are_left_to_vllm_defaults():
    kw = _kw()
    for name in (
        "enable_prefix_caching",
        "enable_chunked_prefill",
        "max_num_batched_tokens",
        "max_num_seqs",
    ):
        assert name not in kw, f"{name} should be left to vLLM's default"


def test_prefix_caching_off_below_sm80_fake_platform(caplog):
    v100 = _FakePlatform(cap=(7, 0))
    with caplog.at_level(logging.WARNING, logger="pipeline.producer.engine"):
        kw = _kw(v100, enable_prefix_caching=True)
    assert kw["enable_prefix_caching"] is False
    assert "prefix caching turned off" in caplog.text and "7.0" in caplog.text
    # Unset (vLLM would default it on): still turned off explicitly.
    assert _kw(v100)["enable_prefix_caching"] is False
    # bf16 is not supported there either.
    assert _kw(v100)["dtype"] == "float16"


def test_prefix_caching_untouched_on_ampere_and_cpu_fake_platform(caplog):
    with caplog.at_level(logging.WARNING, logger="pipeline.producer.engine"):
        assert "enable_prefix_caching" not in _kw(_FakePlatform(cap=(8, 0)))
        assert (
            _kw(_FakePlatform(cap=(9, 0)), enable_prefix_caching=True)["enable_prefix_caching"]
            is True
        )
        assert "enable_prefix_caching" not in _kw(CPU)
    assert "prefix caching" not in caplog.text
    assert _kw(_FakePlatform(cap=(8, 0)))["dtype"] == "bfloat16"


def test_extra_repeating_an_option_is_rejected():
    with pytest.raises(EngineSetupError, match="max_model_len"):
        _kw(extra={"max_model_len": 99})
    with pytest.raises(EngineSetupError, match="max_num_seqs"):
        _kw(max_num_seqs=4, extra={"max_num_seqs": 8})


def test_sleep_when_idle_turns_on_vllm_sleep_mode_on_gpus_fake_platform():
    assert _kw(_FakePlatform(cap=(9, 0)), sleep_when_idle=True)["enable_sleep_mode"] is True
    assert "enable_sleep_mode" not in _kw(_FakePlatform(cap=(9, 0)))


def test_sleep_when_idle_on_cpu_is_one_clear_error():
    with pytest.raises(EngineSetupError, match=r"engine\.sleep_when_idle needs a GPU"):
        _kw(CPU, sleep_when_idle=True)


def test_engine_arg_names_read_from_source_match_the_real_engine_args():
    """engine.extra is checked against names read from vLLM's source (importing vLLM takes
    seconds); they must be exactly the fields of the installed AsyncEngineArgs."""
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    from pipeline.producer.engine import engine_arg_names

    assert engine_arg_names() == {f.name for f in dataclasses.fields(AsyncEngineArgs)}


def test_unknown_engine_extra_is_refused_before_any_engine_starts():
    from pipeline.producer.engine import check_extra

    check_extra({})
    check_extra({"max_logprobs": 5, "disable_log_stats": True})
    with pytest.raises(
        EngineSetupError,
        match=r"^engine\.extra: unknown vLLM engine argument"
        r"\(s\) swap_spce, zzz ",
    ):
        check_extra({"swap_spce": 1, "zzz": 2, "max_logprobs": 5})


def test_lora_rank_enables_vllm_lora_with_an_accepted_max_rank():
    kw = engine_kwargs(ModelConfig(), EngineConfig(), "/m", 0, _FakePlatform(cpu=True),
                       lora_rank=4, max_loras=3)
    assert kw["enable_lora"] is True and kw["max_lora_rank"] == 8
    assert kw["max_loras"] == 3 and kw["max_cpu_loras"] == 4
    assert "enable_lora" not in engine_kwargs(ModelConfig(), EngineConfig(), "/m", 0,
                                              _FakePlatform(cpu=True))


def test_cpu_engines_on_one_machine_get_their_own_cores():
    assert cpu_cores(0, 1, [0, 1]) is None  # one engine: vLLM's own binding
    assert [cpu_cores(i, 2, [0, 1]) for i in range(2)] == ["0", "1"]
    assert [cpu_cores(i, 2, [0, 1, 2, 3, 4]) for i in range(2)] == ["0,1", "2,3"]
    assert [cpu_cores(i, 3, [4, 5]) for i in range(3)] == ["4", "5", "4"]  # turns
    assert cpu_cores(3, 2, [0, 1, 2, 3]) == "2,3"  # a restarted producer's index wraps
