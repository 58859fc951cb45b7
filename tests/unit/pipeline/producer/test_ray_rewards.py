"""``executor: ray`` without a cluster: the spec's Ray options (validation, defaults, errors
naming the option), the batching of calls, the replica class as plain Python, and ``RewardSet``'s
failure handling around the client. The replicas' actor handles are replaced by
``FakeActorHandle`` (in-process stand-ins; the real cluster is tests/e2e/test_reward_actors.py)."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from pipeline.config import RewardSpec, load_config
from pipeline.options import ConfigError
from pipeline.producer.rewards.ray_replicas import (
    HANDLE_ENV,
    RewardReplica,
    RoundRobin,
    batch_items,
    loopback_host,
    replica_names,
    replica_options,
    split_results,
)
from pipeline.producer.rewards.runner import RewardSet

ray = pytest.importorskip("ray")

HERE = __file__


# ------------------------------------------------------------------------------ reward fixtures


class LengthModel:
    """A stand-in reward model: state built in __init__, one score per completion."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def __call__(self, prompt, completion, **meta):
        if completion == "boom":
            raise ValueError("cannot score boom")
        if completion == "nan":
            return float("nan")
        return self.scale * len(completion)


class BatchModel:
    def __call__(self, prompts, completions, metas):
        return [float(len(c)) for c in completions]


class Slow:
    def __call__(self, prompt, completion, **meta):
        time.sleep(2.0)
        return 1.0


# ------------------------------------------------------------------------------------ config


def _cfg(spec: dict, **launch):
    return load_config(
        overrides={"rewards.specs": [spec], **{f"launch.{k}": v for k, v in launch.items()}}
    )


def test_ray_options_defaults_and_names():
    spec = RewardSpec(fn=f"{HERE}:LengthModel", executor="ray")
    o = replica_options(spec)
    assert (o.num_replicas, o.num_cpus, o.num_gpus, o.max_restarts) == (1, 1.0, 0.0, 3)
    spec = RewardSpec(
        fn=f"{HERE}:LengthModel",
        executor="ray",
        num_replicas=2,
        num_cpus=0.5,
        num_gpus=1,
        max_restarts=-1,
    )
    o = replica_options(spec)
    assert (o.num_replicas, o.num_cpus, o.num_gpus, o.max_restarts) == (2, 0.5, 1.0, -1)
    assert replica_names("rm", 2) == ["reward-rm-0", "reward-rm-1"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"num_replicas": 0}, "rewards.specs[0].num_replicas: must be >= 1"),
        ({"num_replicas": "two"}, "rewards.specs[0].num_replicas: expected an integer"),
        ({"num_gpus": -1}, "rewards.specs[0].num_gpus: must be >= 0"),
        ({"num_cpus": "x"}, "rewards.specs[0].num_cpus: expected a number"),
        ({"max_restarts": -2}, "rewards.specs[0].max_restarts: must be >= -1"),
    ],
)
def test_bad_ray_option_names_it(extra, message):
    with pytest.raises(ConfigError) as e:
        _cfg({"fn": f"{HERE}:LengthModel", "executor": "ray", **extra}, backend="ray")
    assert str(e.value).startswith(message), e.value


def test_ray_option_with_another_executor_is_refused():
    with pytest.raises(ConfigError, match=r"rewards.specs\[0\].num_gpus: applies only to "):
        _cfg({"fn": f"{HERE}:LengthModel", "executor": "thread", "num_gpus": 1})


def test_ray_executor_needs_a_cluster():
    with pytest.raises(ConfigError) as e:
        _cfg({"fn": f"{HERE}:LengthModel", "executor": "ray"})
    assert str(e.value).startswith("rewards.specs[0].executor: ray needs a Ray cluster")
    assert "--launcher ray" in str(e.value) and "--ray-address" in str(e.value)
    # Under the Ray launcher, or the local launcher given a cluster: accepted.
    _cfg({"fn": f"{HERE}:LengthModel", "executor": "ray"}, backend="ray")
    _cfg({"fn": f"{HERE}:LengthModel", "executor": "ray"}, ray_address="127.0.0.2:6380")


def test_cli_refuses_ray_executor_under_local_launcher_in_one_line(tmp_path):
    import subprocess
    import sys

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"rewards:\n  specs:\n    - fn: {HERE}:LengthModel\n      executor: ray\n")
    p = subprocess.run(
        [sys.executable, "-m", "pipeline.launch.cli", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "rewards.specs[0].executor: ray needs a Ray cluster" in lines[0]


# ---------------------------------------------------------------------------------- batching


def test_batch_items_and_split_results():
    metas = [{"prompt_id": "p", "completion_index": i} for i in range(3)]
    items = batch_items("q", ["a", "bb", "ccc"], metas)
    assert items == [("q", "a", metas[0]), ("q", "bb", metas[1]), ("q", "ccc", metas[2])]
    assert split_results([(1.0, None), (None, "ValueError('x')"), (2, None)], 3) == [
        (1.0, None),
        (None, "ValueError('x')"),
        (2, None),
    ]
    # A malformed answer fails every completion, never raises.
    assert all(err for _, err in split_results([(1.0, None)], 3))
    assert all(err for _, err in split_results("junk", 2))
    assert split_results([1.0, (2.0, None)], 2)[0][1].startswith("malformed")


def test_round_robin_turns():
    rr = RoundRobin(2)
    assert [rr.take() for _ in range(5)] == [0, 1, 0, 1, 0]
    with pytest.raises(ValueError):
        RoundRobin(0)


def test_replica_as_plain_python():
    r = RewardReplica("len", 0, f"{HERE}:LengthModel", {"scale": 2.0}, "single")
    assert r.info()["loaded"] is False
    assert r.load()["loaded"] is True
    out = r.score_each(batch_items("q", ["ab", "boom", "abc"], [{}, {}, {}]))
    assert out[0] == (4.0, None) and out[2] == (6.0, None)
    assert out[1][0] is None and "cannot score boom" in out[1][1]
    b = RewardReplica("b", 0, f"{HERE}:BatchModel", {}, "batched")
    assert b.score((["q", "q"], ["a", "bcd"], [{}, {}])) == [1.0, 3.0]


# ----------------------------------------------------------------- RewardSet around the client


class FakeActorHandle:
    """Stands in for a replica's Ray actor handle: ``handle.method.remote(x)`` runs the method of
    an in-process ``RewardReplica`` on a thread; the first ``deaths`` calls fail as a replica
    killed under the call does (ActorDiedError)."""

    def __init__(self, replica: RewardReplica, deaths: int = 0):
        self.replica, self.deaths, self.calls = replica, deaths, 0

    def __getattr__(self, method: str):
        return SimpleNamespace(remote=lambda args: self._call(method, args))

    async def _call(self, method: str, args):
        self.calls += 1
        if self.deaths > 0:
            self.deaths -= 1
            raise ray.exceptions.ActorDiedError()
        return await asyncio.to_thread(getattr(self.replica, method), args)


def _ray_set(monkeypatch, cls: str, deaths=(0, 0), on_failure="zero", **spec_kw):
    name = spec_kw.pop("name", "rm")
    monkeypatch.setenv(
        HANDLE_ENV,
        json.dumps({"address": "x:1", "namespace": "n", "rewards": {name: replica_names(name, 2)}}),
    )
    spec = RewardSpec(fn=f"{HERE}:{cls}", executor="ray", name=name, num_replicas=2, **spec_kw)
    rs = RewardSet([spec], on_failure=on_failure)
    mode = rs.rewards[0].mode
    handles = [
        FakeActorHandle(RewardReplica(name, k, spec.fn, {}, mode), deaths=d)
        for k, d in enumerate(deaths)
    ]
    client = rs.rewards[0].remote
    client._actors, client._ray = handles, ray
    return rs, handles


def _score(rs, completions):
    meta = {"prompt_id": "p0"}
    return asyncio.run(rs.score_group("q", completions, meta))


def test_group_goes_as_one_batch_with_per_completion_failures(monkeypatch):
    rs, handles = _ray_set(monkeypatch, "LengthModel")
    res = _score(rs, ["ab", "boom", "nan", "abcd"])
    assert res.total == [2.0, 0.0, 0.0, 4.0] and res.failed and not res.dropped
    assert sum(h.calls for h in handles) == 1  # the group's four completions in one call
    assert rs.stats["reward/rm/calls"] == 4
    assert rs.stats["reward/rm/failures"] == 2 and rs.stats["reward/rm/nan"] == 1
    _score(rs, ["a"])
    assert [h.calls for h in handles] == [1, 1]  # the next call went to the other replica


def test_batched_reward_one_call(monkeypatch):
    rs, handles = _ray_set(monkeypatch, "BatchModel", batched=True)
    assert _score(rs, ["a", "bcd"]).total == [1.0, 3.0]
    assert rs.stats["reward/rm/calls"] == 1 and sum(h.calls for h in handles) == 1


def test_replica_dying_under_a_call_is_retried_on_the_next(monkeypatch):
    rs, handles = _ray_set(monkeypatch, "LengthModel", deaths=(1, 0))
    res = _score(rs, ["ab", "abc"])
    assert res.total == [2.0, 3.0] and not res.failed
    assert rs.stats["reward/rm/retries"] == 1 and rs.stats["reward/rm/failures"] == 0
    assert [h.calls for h in handles] == [1, 1]


def test_both_replicas_dying_is_a_failure_under_the_policy(monkeypatch):
    rs, _ = _ray_set(monkeypatch, "LengthModel", deaths=(1, 1), on_failure="drop")
    res = _score(rs, ["ab", "abc"])
    assert res.dropped and res.total == [0.0, 0.0]
    assert rs.stats["reward/rm/retries"] == 1
    assert rs.stats["reward/rm/failures"] == 2  # counted per completion
    assert rs.stats["reward/rm/dropped_groups"] == 1


def test_timeout_bounds_a_remote_call(monkeypatch):
    rs, _ = _ray_set(monkeypatch, "Slow", timeout_s=0.1)

    async def timed():
        t0 = time.monotonic()
        res = await rs.score_group("q", ["a", "b"], {"prompt_id": "p0"})
        return res, time.monotonic() - t0

    res, took = asyncio.run(timed())
    # The waiting side gave up at 0.1 s, well before the replica's 2 s call (which runs on).
    assert took < 1.5, took
    assert res.failed and res.total == [0.0, 0.0]
    assert rs.stats["reward/rm/timeouts"] == 2 and rs.stats["reward/rm/failures"] == 2


def test_no_handle_is_a_clear_error(monkeypatch):
    monkeypatch.delenv(HANDLE_ENV, raising=False)
    spec = RewardSpec(fn=f"{HERE}:LengthModel", executor="ray", name="rm")
    with pytest.raises(RuntimeError, match="reward 'rm' has executor ray but"):
        RewardSet([spec])


def test_loopback_node_ip():
    assert loopback_host("127.0.0.2:6379") == "127.0.0.2"
    assert loopback_host("10.0.0.5:6379") == ""


def test_eval_needs_a_cluster_for_ray_rewards():
    from pipeline.launch.evaluation import _reward_cluster

    cfg = _cfg({"fn": f"{HERE}:LengthModel", "executor": "ray"}, backend="ray")
    with pytest.raises(ConfigError, match=r"rewards.specs\[0\].executor: .*launch.ray_address"):
        _reward_cluster(cfg)
    assert _reward_cluster(load_config()) is None
