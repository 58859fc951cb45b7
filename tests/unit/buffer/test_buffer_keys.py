"""``buffer.keys``: CURVE key files created private (0700 directory, 0600 secrets) and refused
when others can read a secret, as ssh refuses an unprotected private key; a producer node never
makes keys of its own. Real files, real zmq.auth keys."""

from __future__ import annotations

import os
import stat

import pytest

from buffer.keys import generate_curve_keys, load_curve_keys


@pytest.fixture
def loose_umask():
    old = os.umask(0o022)  # the usual default: plain files would come out 0644
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_are_created_private(tmp_path, loose_umask):
    d = tmp_path / "nested" / "keys"
    keys = generate_curve_keys(d)
    assert _mode(d) == 0o700
    assert _mode(d / "server.key_secret") == 0o600 and _mode(d / "client.key_secret") == 0o600
    assert _mode(d / "server.key") == 0o644  # public halves are meant to be copied
    assert sorted(p.name for p in d.iterdir()) == [
        "client.key",
        "client.key_secret",
        "server.key",
        "server.key_secret",
    ]
    assert generate_curve_keys(d) == keys  # read back, not made again


@pytest.mark.parametrize(
    "role,secret",
    [
        ("learner", "server.key_secret"),
        ("learner", "client.key_secret"),
        ("producer", "client.key_secret"),
    ],
)
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_secret_key_others_can_access_is_refused(tmp_path, role, secret, mode):
    d = tmp_path / "keys"
    generate_curve_keys(d)
    (d / secret).chmod(mode)
    with pytest.raises(PermissionError) as e:
        load_curve_keys(d, role)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"secret key {d / secret} is accessible by others (mode {mode:04o})" in msg
    assert f"chmod 600 {d / secret}" in msg
    (d / secret).chmod(0o600)
    assert load_curve_keys(d, role).client_secret is not None


def test_a_producer_node_never_makes_keys(tmp_path):
    d = tmp_path / "node"
    d.mkdir()
    with pytest.raises(FileNotFoundError, match=r"CURVE keys missing: .*server\.key"):
        load_curve_keys(d, "producer")
    assert not list(d.iterdir())
