"""``pipeline.keys``: a role's CurveZMQ keys from ``RunConfig.curve_keys``, a bad key file
turned into one ConfigError naming the option (the key files themselves: tests/unit/buffer)."""

from __future__ import annotations

import pytest

from buffer.keys import generate_curve_keys
from pipeline.config import load_config
from pipeline.keys import curve_keys
from pipeline.options import ConfigError


def test_no_key_directory_is_plain_zeromq(tmp_path):
    assert curve_keys(load_config(overrides={"run_dir": str(tmp_path)}), "learner") is None


def test_an_unsafe_key_file_is_a_config_error_naming_curve_keys(tmp_path):
    d = tmp_path / "keys"
    generate_curve_keys(d)
    (d / "client.key_secret").chmod(0o644)
    cfg = load_config(overrides={"curve_keys": str(d), "run_dir": str(tmp_path / "run")})
    with pytest.raises(ConfigError, match=r"^curve_keys: secret key .* chmod 600"):
        curve_keys(cfg, "producer")
