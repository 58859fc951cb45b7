"""The run's CurveZMQ keys, as the learner, the producers and the launcher read them from
``RunConfig.curve_keys``: a directory the learner fills on first use and every producer node
holds a copy of (``buffer.keys`` owns the key files themselves). Every place that opens an
endpoint of a role goes through it, so a bad key directory is the same ConfigError everywhere."""

from __future__ import annotations

from buffer.keys import CurveKeys, load_curve_keys
from pipeline.config import RunConfig
from pipeline.options import ConfigError


def curve_keys(cfg: RunConfig, role: str) -> CurveKeys | None:
    """This role's ``CurveKeys`` from ``cfg.curve_keys`` (None: plain ZeroMQ); the learner's
    are created on first use. A missing or unsafe key file is one ConfigError naming
    ``curve_keys``."""
    if not cfg.curve_keys:
        return None
    try:
        return load_curve_keys(cfg.curve_keys, role)
    except (OSError, ValueError) as e:
        raise ConfigError(f"curve_keys: {e}") from None
