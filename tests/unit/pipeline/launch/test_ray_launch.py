"""The Ray launcher's pure parts: launch options, bundles, the "what is missing" message (with a
fake of ray's cluster queries), key material, and the CLI's one-line errors (no cluster needed)."""

from __future__ import annotations

import pytest

from pipeline.config import flatten, load_config
from pipeline.launch.cli import main, parse
from pipeline.launch.ray import make_keys
from pipeline.launch.ray_actors import KEY_FILES, role_workdir
from pipeline.launch.ray_placement import bundle, why_unplaced
from pipeline.options import ConfigError, to_dict


def test_flags_and_yaml_reach_the_launch_section():
    cfg, _ = parse(
        [
            "--launcher",
            "ray",
            "--ray-address",
            "10.0.0.1:6380",
            "--set",
            "launch.producer_resources={producer_node: 1}",
        ]
    )
    assert cfg.launch.backend == "ray" and cfg.launch.ray_address == "10.0.0.1:6380"
    # Mapping options survive the child's rebuild from a flat dict.
    again = load_config(overrides=flatten(to_dict(cfg)))
    assert again.launch.producer_resources == {"producer_node": 1}


@pytest.mark.parametrize(
    "key,value,option",
    [
        ("launch.backend", "slurm", "launch.backend"),
        ("launch.ray_address", "not an address", "launch.ray_address"),
        ("launch.learner_resources", {"x": -1}, "launch.learner_resources"),
        ("launch.producer_labels", {"zone": 3}, "launch.producer_labels"),
        ("launch.producer_strategy", "RANDOM", "launch.producer_strategy"),
        ("launch.stream_weights", "sometimes", "launch.stream_weights"),
        ("sync.stream_from", "http://x", "sync.stream_from"),
    ],
)
def test_bad_launch_values_name_the_option(key, value, option):
    with pytest.raises(ConfigError, match=option):
        load_config(overrides={key: value})


def test_cli_bad_input_is_one_line_exit_2(capsys):
    assert main(["--launcher", "ray", "--role", "producer"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--role" in err[0]
    assert main(["--launcher", "nope"]) == 2
    assert "launch.backend" in capsys.readouterr().err


def test_bundles_drop_zero_amounts():
    assert bundle(1, 0, {"learner_node": 1}) == {"CPU": 1.0, "learner_node": 1.0}
    assert bundle(0, 0, {}) == {}


class FakeRay:
    """Answers the two cluster queries why_unplaced makes, from a fixed node table."""

    def __init__(self, nodes):
        self._nodes = nodes

    def nodes(self):
        return [{"Alive": True, "Resources": r} for r in self._nodes]

    def cluster_resources(self):
        total: dict[str, float] = {}
        for r in self._nodes:
            for k, v in r.items():
                total[k] = total.get(k, 0) + v
        return total


def test_missing_names_the_resource():
    ray = FakeRay([{"CPU": 2, "producer_node": 1}, {"CPU": 2, "learner_node": 1}])
    assert "no node has resource 'GPU'" in why_unplaced(ray, {"CPU": 1, "GPU": 1}, {})
    assert "has 4 CPU in all" in why_unplaced(ray, {"CPU": 8}, {})
    assert "no single node" in why_unplaced(
        ray, {"CPU": 1, "producer_node": 1, "learner_node": 1}, {})
    assert "labels" in why_unplaced(ray, {"CPU": 1}, {"zone": "a"})


def test_keys_are_certificate_files_of_z85_key_pairs(tmp_path):
    import zmq.auth

    keys = make_keys()
    assert set(KEY_FILES) <= set(keys)
    assert b"secret-key" in keys["server.key_secret"] and b"secret-key" not in keys["server.key"]
    for name in ("server", "client"):
        (tmp_path / f"{name}.key_secret").write_bytes(keys[f"{name}.key_secret"])
        public, secret = zmq.auth.load_certificate(tmp_path / f"{name}.key_secret")
        assert len(public) == 40 and len(secret) == 40


def test_workdir_is_run_dir_on_the_driver_node_else_node_local(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    assert role_workdir("/runs/a", True).as_posix() == "/runs/a"
    local = role_workdir("/runs/a", False)
    assert local.parent == tmp_path / "pipeline-grpo-ray" and local.name.startswith("a-")
    assert role_workdir("/runs/a", False) == local and role_workdir("/other/a", False) != local



@pytest.mark.parametrize("group_exists", [True, False])
def test_stopping_a_role_signals_its_child_once_mocked_kill(monkeypatch, group_exists):
    """Two SIGINTs would interrupt the learner's final checkpoint (the first cancels its main
    task, the second raises KeyboardInterrupt inside it): the actor's stop sends one, to the
    child's group, or to the child alone before it has made its group. Pure signalling logic:
    os.killpg / os.kill are replaced by recorders, the actor object is made without Ray."""
    import signal
    import types

    import pipeline.launch.ray_actors as ray_actors

    sent = []

    def killpg(pid, sig):
        if not group_exists:
            raise ProcessLookupError
        sent.append(("group", pid, sig))

    monkeypatch.setattr(ray_actors.os, "killpg", killpg)
    monkeypatch.setattr(ray_actors.os, "kill", lambda pid, sig: sent.append(("pid", pid, sig)))
    role = object.__new__(ray_actors.RoleActor)
    role.proc = types.SimpleNamespace(pid=4242)
    role._kill(signal.SIGINT)
    assert sent == [("group" if group_exists else "pid", 4242, signal.SIGINT)]


def test_a_producer_role_is_signalled_alone_before_its_group_mocked_kill(monkeypatch):
    """A producer actor's stop signals the producer process alone (it shuts its engine down in
    order: a signal to the group would kill vLLM's workers under a live engine core), and only
    what is left after the grace period gets SIGKILL with its group; the learner's stop
    signals the group. Pure signalling logic: os.killpg / os.kill replaced by recorders, the
    actor objects made without Ray, the child's join a no-op."""
    import signal
    import types

    import pipeline.launch.ray_actors as ray_actors
    import pipeline.procs

    sent = []
    monkeypatch.setattr(ray_actors.os, "killpg", lambda pid, sig: sent.append(("group", sig)))
    monkeypatch.setattr(ray_actors.os, "kill", lambda pid, sig: sent.append(("pid", sig)))
    monkeypatch.setattr(pipeline.procs, "wait_group_gone", lambda pid: None)
    for cls, first in ((ray_actors.ProducerActor, "pid"), (ray_actors.LearnerActor, "group")):
        sent.clear()
        role = object.__new__(cls)
        role.proc = types.SimpleNamespace(pid=4242, join=lambda t=None: None, exitcode=0)
        role.keys_dir = None
        role.stop(signal.SIGTERM, 0.0)
        assert sent == [(first, signal.SIGTERM), ("group", signal.SIGKILL)], cls
