"""Dynamic sampling (``pipeline.producer.sampling``): the drop rule, the per-step cap, a lock-step
admission simulation with drops (as ``tests/unit/buffer/test_buffer_staleness.py``'s, with groups
that take a phase to generate), and the producer's drop path (``GroupRollout.start``: real
RewardSet, sent log and counters; the engine request is a fake, named so)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import pytest
from producer_fakes import Cursor, RecordingEndpoint, completion_fake, producer_fake_engine

from buffer.protocol import Announce
from buffer.schema import RolloutGroup
from buffer.staleness import admission_budget, may_admit
from pipeline.config import load_config
from pipeline.options import ConfigError
from pipeline.producer.data import PromptRecord
from pipeline.producer.sampling import DropCap, extra_cap, is_uninformative, reward_std

# ------------------------------------------------------------------ the rule and the cap


def test_a_group_is_uninformative_when_its_rewards_are_all_equal():
    assert is_uninformative([1.0, 1.0, 1.0]) and is_uninformative([0.0, 0.0])
    assert not is_uninformative([1.0, 1.0, 0.0])
    assert not is_uninformative([0.5, 0.5 + 1e-9])  # any difference is a signal at min_std 0


def test_min_std_also_drops_groups_whose_rewards_barely_differ():
    rewards = [1.0, 1.0, 1.0, 0.9]
    assert reward_std(rewards) == pytest.approx(0.05)  # sample std, as the loss scales by
    assert is_uninformative(rewards, min_std=0.1)
    assert not is_uninformative(rewards, min_std=0.01)
    assert is_uninformative([2.0, 2.0], min_std=0.01)


@pytest.mark.parametrize("num_producers", [1, 2, 3, 8])
def test_the_cap_is_a_multiple_of_each_producers_share_of_a_batch(num_producers):
    caps = [extra_cap(6, 2.0, num_producers, k) for k in range(num_producers)]
    if num_producers <= 6:
        assert sum(caps) == 12  # 2 x the batch, shared out like the batch
    assert min(caps) >= 2  # a producer with no share of the batch may still drop its 2
    assert extra_cap(4, 0.5, 1, 0) == 2 and extra_cap(4, 0.3, 1, 0) == 2  # rounded up


def test_drop_cap_counts_per_learner_step_and_restarts_at_the_next():
    cap = DropCap(2)
    assert cap.drop(0) and cap.drop(0)
    assert not cap.drop(0) and not cap.drop(0)  # spent: sent as they are
    assert cap.capped_windows == 1
    assert cap.drop(4) and cap.drop(4) and not cap.drop(4)  # the learner took a batch
    assert cap.capped_windows == 2
    with pytest.raises(ValueError):
        DropCap(0)


def test_config_validates_the_options():
    cfg = load_config(overrides={"generation.dynamic_sampling": True})
    g = cfg.generation
    assert g.dynamic_sampling and g.dynamic_sampling_min_std == 0.0
    assert g.dynamic_sampling_max_extra == 4.0
    assert not load_config().generation.dynamic_sampling  # off by default
    for key, value in (("dynamic_sampling_max_extra", 0), ("dynamic_sampling_min_std", -0.1),
                       ("dynamic_sampling_max_extra", float("inf"))):
        with pytest.raises(ConfigError, match=f"generation.{key}"):
            load_config(overrides={f"generation.{key}": value})


# ------------------------------------------------------------------ admission with drops


def _simulate(max_staleness: int, uninformative: Callable[[int], bool], *, max_extra=4.0,
              steps=8, batch=4, over_admit=1) -> dict:
    """One producer and the learner in lock-step. Each phase, the groups generating end (an
    uninformative one is dropped while the step's cap allows) and the producer admits while
    ``may_admit`` lets it; the learner waits until a batch is buffered, takes it, trains (the
    producer admits meanwhile, at the learner's heading_to), publishes, and the engine swaps.
    ``over_admit`` > 1 is the rule this design refuses: a budget of expected informative groups
    (budget x 1/(1 - drop rate)) instead of a hard count."""
    learner = engine = heading = consumed = 0
    generating: list[tuple[int, int]] = []  # (engine version at admission, prompt number)
    buffered: list[tuple[int, bool]] = []  # (policy_version, informative)
    cap = DropCap(extra_cap(batch, max_extra, 1, 0))
    out = {"staleness": [], "informative": [], "generated": 0, "dropped": 0, "trained": 0}
    prompt = 0

    def admit() -> None:
        nonlocal prompt
        while may_admit((len(generating) + len(buffered)) // over_admit, batch, max_staleness,
                        1, 0, engine, heading):
            generating.append((engine, prompt))
            prompt += 1

    def finish() -> None:
        for version, p in generating:
            out["generated"] += 1
            bad = uninformative(p)
            if bad and cap.drop(consumed):
                out["dropped"] += 1
            else:
                buffered.append((version, not bad))
        generating.clear()

    for _ in range(steps):
        finish()  # what was generating when the engine swapped ends
        rounds = 0
        while len(buffered) < batch:  # the learner waits for a batch
            admit()
            finish()
            rounds += 1
            assert rounds < 1000, "no batch: the producer spins"
        taken, buffered[:] = buffered[:batch], buffered[batch:]
        consumed += batch
        out["trained"] += batch
        out["staleness"] += [learner - v for v, _ in taken]
        out["informative"].append(sum(ok for _, ok in taken))
        heading = learner + 1
        admit()  # while the learner trains
        learner = engine = heading  # publish, swap
    assert out["generated"] == out["trained"] + out["dropped"] + len(buffered)  # conservation
    out["capped_steps"] = cap.capped_windows
    out["cap"] = cap.cap
    return out


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
@pytest.mark.parametrize("every", [2, 3])  # 1/2 or 2/3 of the prompts have all-equal rewards
def test_dropped_groups_are_replaced_and_every_replacement_is_trainable_in_time(max_staleness,
                                                                                every):
    sim = _simulate(max_staleness, lambda p: p % every != 0)
    assert max(sim["staleness"]) <= max_staleness
    assert sim["dropped"] > 0 and sim["capped_steps"] == 0
    assert sim["informative"] == [4] * 8  # every batch full of informative groups


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_an_all_solved_prompt_set_stops_at_the_cap_and_trains_what_it_has(max_staleness):
    sim = _simulate(max_staleness, lambda p: True, max_extra=2.0)
    assert max(sim["staleness"]) <= max_staleness
    assert sim["informative"] == [0] * 8  # the steps train on the uninformative groups
    assert sim["capped_steps"] >= 1
    assert sim["dropped"] <= sim["cap"] * (8 + 1)  # at most the cap per learner step


def test_without_a_cap_an_all_solved_prompt_set_never_fills_a_batch():
    with pytest.raises(AssertionError, match="spins"):
        _simulate(0, lambda p: True, max_extra=1e6)


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_budget_of_expected_informative_groups_starts_groups_too_stale_to_train(max_staleness):
    """Admitting 2x the budget, expecting half the groups to be dropped: when they are not,
    groups are trained beyond max_staleness (the buffer would drop them as stale)."""
    assert max(_simulate(max_staleness, lambda p: False)["staleness"]) <= max_staleness
    assert max(_simulate(max_staleness, lambda p: False, over_admit=2)["staleness"]) \
        > max_staleness
    assert admission_budget(4, max_staleness) == 4 * (max_staleness + 1)


# ------------------------------------------------------------------ the producer's drop path


def _producer(tmp_path, *, on=True, max_extra=4.0, batch_groups=2):
    endpoint = RecordingEndpoint()
    p = producer_fake_engine(tmp_path, endpoint, **{
        "generation.dynamic_sampling": on, "generation.dynamic_sampling_max_extra": max_extra,
        "train.batch_groups": batch_groups})
    return p, endpoint


def _generate_one_fake(equal: bool):
    """Completions 'a', 'a', 'a' (equal rewards) or 'a', 'aa', 'aaa' (different ones)."""
    async def generate(rid, prompt_ids, sp):
        return completion_fake(1 if equal else int(rid.rsplit("-", 1)[1]) + 1)
    return generate


def _run(p, equal: bool, n: int = 1) -> None:
    p.rollout._generate_one = _generate_one_fake(equal)

    async def run() -> None:
        for i in range(n):
            await p.rollout.start(PromptRecord(f"q{i}", "Q?", {}, i + 1), [81, 63])
    asyncio.run(run())


def _sent(endpoint) -> list[RolloutGroup]:
    return [m for m in endpoint.sent if isinstance(m, RolloutGroup)]


def _log(p) -> list[dict]:
    return [json.loads(x) for x in p.rollout.sent_log.read_text().splitlines()]


def test_the_producer_drops_a_zero_variance_group_counts_it_and_logs_it(tmp_path):
    p, endpoint = _producer(tmp_path)
    _run(p, equal=True)
    assert _sent(endpoint) == [] and p.rollout.seq == 0 and len(p.outbox.unconfirmed()) == 0
    assert p.heartbeat_stats()["groups_dropped_zero_variance"] == 1
    (rec,) = _log(p)
    assert rec["prompt_id"] == "q0" and rec["dropped_zero_variance"].startswith("p0-")
    _run(p, equal=False)  # rewards differ: sent
    assert len(_sent(endpoint)) == 1 and p.stats.groups_sent == 1
    assert [("seq" in r) for r in _log(p)] == [False, True]


def test_off_by_default_a_zero_variance_group_is_sent(tmp_path):
    p, endpoint = _producer(tmp_path, on=False)
    _run(p, equal=True)
    assert len(_sent(endpoint)) == 1 and p.stats.groups_dropped_zero_variance == 0


def test_past_the_cap_the_steps_groups_are_sent_with_one_warning(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pipeline.producer")
    p, endpoint = _producer(tmp_path, max_extra=1.5, batch_groups=2)  # cap: 3 per step
    _run(p, equal=True, n=5)
    assert p.stats.groups_dropped_zero_variance == 3 and len(_sent(endpoint)) == 2
    assert p.stats.dynamic_sampling_cap_hits == 1
    warnings = [r for r in caplog.records if "uninformative" in r.getMessage()]
    assert [r.levelno for r in warnings] == [logging.WARNING]
    p.rollout.learner_consumed = 2  # the learner took a batch: a new step, the cap starts again
    _run(p, equal=True, n=5)
    assert p.stats.groups_dropped_zero_variance == 6 and len(_sent(endpoint)) == 4
    assert p.stats.dynamic_sampling_cap_hits == 2
    warnings = [r for r in caplog.records if "uninformative" in r.getMessage()]
    assert [r.levelno for r in warnings] == [logging.WARNING, logging.INFO]  # later: the log file


def test_the_announces_consumption_counts_start_a_new_step_for_the_cap(tmp_path):
    """The learner taking a batch shows in the Announce's ``consumed`` (all producers): the
    cap counts again from zero."""
    p, endpoint = _producer(tmp_path, max_extra=1.0, batch_groups=2)  # cap: 2 per step
    p.prompts = Cursor()

    def announce(consumed: dict[str, int]) -> None:
        asyncio.run(p._apply_announce(Announce(
            version=0, snapshot_uri="", snapshot_checksum="", learner_session="s",
            received=dict(consumed), consumed=consumed)))

    announce({"p0": 0})
    _run(p, equal=True, n=3)
    assert (p.stats.groups_dropped_zero_variance, len(_sent(endpoint))) == (2, 1)
    announce({"p0": 0})  # the periodic announce, nothing taken: the same step
    _run(p, equal=True)
    assert (p.stats.groups_dropped_zero_variance, len(_sent(endpoint))) == (2, 2)
    announce({"p0": 1, "p1": 1})  # a batch of 2 taken
    _run(p, equal=True, n=3)
    assert (p.stats.groups_dropped_zero_variance, len(_sent(endpoint))) == (4, 3)
    assert p.rollout.learner_consumed == 2
