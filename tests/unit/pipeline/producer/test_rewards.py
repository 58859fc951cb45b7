"""Reward actors: every user reward form, weighting, failure handling, executors and limits.

Real asyncio, real threads and a real spawn process pool. Rewards used in a process pool are
named by this file's path (``<file>.py:attr``), which the spawned workers import on their own.
"""

import asyncio
import logging
import math
import os
import threading
import time
from pathlib import Path

import pytest

from pipeline.config import RewardSpec
from pipeline.producer.rewards.loading import load_callable, reward, validate_specs
from pipeline.producer.rewards.runner import RewardResult, RewardSet

HERE = __file__


# ----------------------------------------------------------------------------- reward fixtures


def length_score(prompt, completion, **meta):
    return float(len(completion))


async def async_contains(prompt, completion, **meta):
    await asyncio.sleep(0.001)
    return 1.0 if meta["answer"] in completion else 0.0


def strict_signature(prompt, completion, answer):
    """No **meta: gets only the keywords it names (no prompt_id, completion_index)."""
    return 1.0 if completion == answer else 0.0


class Verifier:
    """A class reward: constructed once with kwargs, its __call__ scores."""

    instances = 0

    def __init__(self, target: str, bonus: float = 0.0):
        Verifier.instances += 1
        self.target = target
        self.bonus = bonus
        self.calls = 0

    def __call__(self, prompt, completion, **meta):
        self.calls += 1
        return (1.0 if self.target in completion else 0.0) + self.bonus


class AsyncVerifier:
    def __init__(self, expected: str):
        self.expected = expected

    async def __call__(self, prompt, completion, **meta):
        await asyncio.sleep(0)
        return float(completion == self.expected)


@reward(name="batch_len", batched=True, weight=0.5)
def batched_len(prompts, completions, metas):
    assert len(prompts) == len(completions) == len(metas)
    return [float(len(c)) for c in completions]


async def async_batched_index(prompts, completions, metas):
    return [float(m["completion_index"]) for m in metas]


def raises(prompt, completion, **meta):
    if completion == "bad":
        raise RuntimeError("verifier crashed")
    return 1.0


async def hangs_async(prompt, completion, **meta):
    await asyncio.sleep(3600)
    return 1.0


def hangs_sync(prompt, completion, **meta):
    time.sleep(3.0)  # a thread cannot be killed: keep it short so the test run stays tidy
    return 1.0


def returns_nan(prompt, completion, **meta):
    return math.nan if completion == "x" else 2.0


def batched_with_inf(prompts, completions, metas):
    return [math.inf if c == "x" else 1.0 for c in completions]


def returns_junk(prompt, completion, **meta):
    return "one"


def batched_wrong_length(prompts, completions, metas):
    return [1.0]


def cpu_square(prompt, completion, **meta):
    """Runs in a worker process: report the pid so the test can tell."""
    import os

    return float(len(completion) ** 2) + 0.0 * os.getpid()


def worker_pid(prompt, completion, **meta):
    import os

    return float(os.getpid())


class ProcessVerifier:
    def __init__(self, offset: float):
        self.offset = offset

    async def __call__(self, prompt, completion, **meta):
        return float(len(completion)) + self.offset


def hangs_in_process(prompt, completion, **meta):
    time.sleep(60)
    return 1.0


def hangs_ignoring_sigterm(prompt, completion, **meta):
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL stops this worker
    Path(meta["marker_dir"], str(os.getpid())).touch()
    time.sleep(60)
    return 1.0


CONCURRENCY = {"now": 0, "peak": 0}
CONCURRENCY_LOCK = threading.Lock()


async def tracks_concurrency(prompt, completion, **meta):
    with CONCURRENCY_LOCK:
        CONCURRENCY["now"] += 1
        CONCURRENCY["peak"] = max(CONCURRENCY["peak"], CONCURRENCY["now"])
    await asyncio.sleep(0.02)
    with CONCURRENCY_LOCK:
        CONCURRENCY["now"] -= 1
    return 1.0


def spec(fn, **kw) -> RewardSpec:
    return RewardSpec(fn=f"{HERE}:{fn}" if isinstance(fn, str) else fn, **kw)


def score(rs: RewardSet, completions, prompt="p", **meta) -> RewardResult:
    meta.setdefault("prompt_id", "pid-1")
    return asyncio.run(rs.score_group(prompt, completions, meta))


# ---------------------------------------------------------------------------------- the forms


def test_sync_function_by_import_path_and_stats():
    with RewardSet([spec("length_score")]) as rs:
        res = score(rs, ["a", "abc", ""])
    assert res.total == [1.0, 3.0, 0.0]
    assert res.breakdown == [{"length_score": 1.0}, {"length_score": 3.0}, {"length_score": 0.0}]
    assert not res.failed and not res.dropped
    assert rs.stats["reward/length_score/calls"] == 3
    assert rs.stats["reward/length_score/failures"] == 0


def test_counters_are_reported_once_the_rewards_have_run():
    """A set that never scored a group (episodes that return their own rewards) reports no
    counters: all-zero ones would read as rewards that ran and never failed."""
    with RewardSet([spec("length_score")]) as rs:
        assert rs.reported_stats() == {}
        score(rs, ["a"])
        reported = rs.reported_stats()
    assert reported["reward/length_score/calls"] == 1
    assert reported["reward/length_score/failures"] == 0 and "reward/dropped_groups" in reported


def test_async_function_gets_meta():
    with RewardSet([spec(async_contains)]) as rs:
        res = score(rs, ["it is 19", "20"], answer="19")
    assert res.total == [1.0, 0.0]


def test_strict_signature_receives_only_named_meta():
    with RewardSet([spec(strict_signature)]) as rs:
        res = score(rs, ["19", "18"], answer="19", other="ignored")
    assert res.total == [1.0, 0.0]
    assert not res.failed


def test_class_is_instantiated_once_with_kwargs_and_keeps_state():
    before = Verifier.instances
    rs = RewardSet([spec(Verifier, kwargs={"target": "ok", "bonus": 0.25})])
    assert Verifier.instances == before + 1
    first = score(rs, ["ok", "no"])
    second = score(rs, ["ok ok"])  # a second asyncio.run: the set is reusable across loops
    assert first.total == [1.25, 0.25]
    assert second.total == [1.25]
    assert rs.rewards[0].scorer.fn.calls == 3
    assert Verifier.instances == before + 1
    rs.close()


def test_async_class():
    with RewardSet([spec(AsyncVerifier, kwargs={"expected": "y"})]) as rs:
        assert score(rs, ["y", "n"]).total == [1.0, 0.0]


def test_batched_decorator_defaults_and_one_call_per_group():
    with RewardSet([spec("batched_len")]) as rs:
        res = score(rs, ["ab", "abcd"])
    # @reward(name="batch_len", batched=True, weight=0.5)
    assert rs.names == ["batch_len"]
    assert res.breakdown == [{"batch_len": 2.0}, {"batch_len": 4.0}]
    assert res.total == [1.0, 2.0]
    assert rs.stats["reward/batch_len/calls"] == 1


def test_spec_fields_override_decorator():
    with RewardSet([spec("batched_len", name="n", weight=2.0)]) as rs:
        assert score(rs, ["abc"]).total == [6.0]
        assert rs.names == ["n"]


def test_async_batched_sees_completion_index():
    with RewardSet([spec(async_batched_index, batched=True)]) as rs:
        assert score(rs, ["a", "b", "c"]).total == [0.0, 1.0, 2.0]


def test_weighted_combination():
    specs = [
        spec(length_score, weight=0.1),
        spec(Verifier, kwargs={"target": "9"}, weight=2.0),
        spec(batched_len, weight=-1.0, name="neg_len"),
    ]
    with RewardSet(specs) as rs:
        res = score(rs, ["19", "abc"])
    assert res.total == pytest.approx([0.1 * 2 + 2.0 * 1 - 2, 0.1 * 3 + 0 - 3])
    assert res.breakdown[0] == {"length_score": 2.0, "Verifier": 1.0, "neg_len": 2.0}


def test_empty_group():
    with RewardSet([spec(length_score), spec(batched_len)]) as rs:
        res = score(rs, [])
    assert res == RewardResult(total=[], breakdown=[], failed=False, dropped=False)


# ------------------------------------------------------------------------------------ failures


def test_exception_zero_policy_counts_and_logs_prompt_id(caplog):
    with (
        RewardSet([spec(raises), spec(length_score)], on_failure="zero") as rs,
        caplog.at_level(logging.WARNING, logger="pipeline.producer.rewards.runner"),
    ):
        res = score(rs, ["good", "bad"], prompt_id="q-42")
    assert res.total == [5.0, 3.0]  # the failed reward counts 0, the other still counts
    assert res.breakdown[1] == {"raises": 0.0, "length_score": 3.0}
    assert res.failed and not res.dropped
    assert rs.stats["reward/raises/calls"] == 2
    assert rs.stats["reward/raises/failures"] == 1
    assert rs.stats["reward/dropped_groups"] == 0
    assert "q-42" in caplog.text and "verifier crashed" in caplog.text


def test_drop_policy_marks_group_and_counts():
    with RewardSet([spec(raises), spec(length_score)], on_failure="drop") as rs:
        ok = score(rs, ["good"])
        bad = score(rs, ["good", "bad"])
    assert not ok.dropped and not ok.failed
    assert bad.dropped and bad.failed
    assert rs.stats["reward/dropped_groups"] == 1
    assert rs.stats["reward/raises/dropped_groups"] == 1
    assert rs.stats["reward/length_score/dropped_groups"] == 0


def test_async_hang_times_out():
    with RewardSet([spec(hangs_async, timeout_s=0.2), spec(length_score)]) as rs:
        t0 = time.monotonic()
        res = score(rs, ["a", "bb"])
        elapsed = time.monotonic() - t0
    assert elapsed < 30, elapsed  # timed out at 0.2 s; the reward hangs for an hour
    assert res.total == [1.0, 2.0] and res.failed
    assert rs.stats["reward/hangs_async/timeouts"] == 2
    assert rs.stats["reward/hangs_async/failures"] == 2


def test_blocking_sync_hang_in_thread_times_out():
    with RewardSet([spec(hangs_sync, timeout_s=0.2, executor="thread")]) as rs:
        t0 = time.monotonic()
        res = score(rs, ["a"])
        assert time.monotonic() - t0 < 2.5  # timed out at 0.2 s, not after the 3 s call
    assert res.total == [0.0] and res.failed
    assert rs.stats["reward/hangs_sync/timeouts"] == 1


def test_thread_executor_runs_off_loop():
    loop_thread = threading.get_ident()
    seen = []

    def where(prompt, completion, **meta):
        seen.append(threading.get_ident())
        return 1.0

    with RewardSet([spec(where, executor="thread")]) as rs:
        assert score(rs, ["a", "b"]).total == [1.0, 1.0]
    assert seen and loop_thread not in seen


def test_nan_and_inf_are_failures():
    with RewardSet([spec(returns_nan), spec(batched_with_inf, batched=True)]) as rs:
        res = score(rs, ["x", "y"])
    assert res.breakdown == [
        {"returns_nan": 0.0, "batched_with_inf": 0.0},
        {"returns_nan": 2.0, "batched_with_inf": 1.0},  # finite entries of the batch are kept
    ]
    assert res.total == [0.0, 3.0] and res.failed
    assert rs.stats["reward/returns_nan/nan"] == 1
    assert rs.stats["reward/batched_with_inf/nan"] == 1
    assert all(math.isfinite(t) for t in res.total)


def test_junk_and_wrong_length_results_are_failures():
    specs = [spec(returns_junk), spec(batched_wrong_length, batched=True)]
    with RewardSet(specs, on_failure="drop") as rs:
        res = score(rs, ["a", "b"])
    assert res.dropped and res.total == [0.0, 0.0]
    assert rs.stats["reward/returns_junk/failures"] == 2
    assert rs.stats["reward/batched_wrong_length/failures"] == 1


# ------------------------------------------------------------------------------ process pools


def test_process_executor_function_and_class_by_file_path():
    specs = [
        spec("cpu_square", executor="process"),
        spec("ProcessVerifier", kwargs={"offset": 10.0}, executor="process"),
        spec("worker_pid", executor="process", weight=0.0),
    ]
    with RewardSet(specs, pool_workers=1) as rs:
        res = score(rs, ["ab", "abc"])
    assert [b["cpu_square"] for b in res.breakdown] == [4.0, 9.0]
    assert [b["ProcessVerifier"] for b in res.breakdown] == [12.0, 13.0]
    import os

    assert all(b["worker_pid"] != os.getpid() for b in res.breakdown)
    assert res.total == [16.0, 22.0]


def test_process_hang_times_out_and_close_terminates_worker():
    rs = RewardSet([spec("hangs_in_process", executor="process", timeout_s=0.5)], pool_workers=1)
    t0 = time.monotonic()
    res = score(rs, ["a"])
    assert time.monotonic() - t0 < 30  # includes the spawn start of the worker
    assert res.failed and rs.stats["reward/hangs_in_process/timeouts"] == 1
    procs = list(rs.pool.processes())
    assert procs and all(p.is_alive() for p in procs)
    rs.close()
    assert not any(p.is_alive() for p in procs)
    # After close, calls fail cleanly rather than raising.
    after = score(rs, ["a"])
    assert after.failed and after.total == [0.0]


def test_close_escalates_to_sigkill_and_returns_only_when_workers_are_gone(tmp_path):
    """A worker that ignores SIGTERM is killed after the grace period; close() returns only
    once every worker has exited (its exit code is known), never with one still running."""
    rs = RewardSet(
        [spec("hangs_ignoring_sigterm", executor="process", timeout_s=0.5)], pool_workers=2
    )
    res = score(rs, ["a", "b"], marker_dir=str(tmp_path))
    assert res.failed and rs.stats["reward/hangs_ignoring_sigterm/timeouts"] == 2
    procs = list(rs.pool.processes())
    deadline = time.monotonic() + 60  # the timeout may fire before the spawned workers start
    while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {p.name for p in tmp_path.iterdir()} == {str(p.pid) for p in procs}
    assert procs and all(p.is_alive() for p in procs)
    rs.close()
    assert all(p.exitcode is not None for p in procs)
    assert all(p.exitcode == -9 for p in procs), [p.exitcode for p in procs]  # SIGKILL


# ------------------------------------------------------------------------------------- limits


def test_max_concurrency_bounds_parallel_calls():
    CONCURRENCY.update(now=0, peak=0)
    with RewardSet([spec(tracks_concurrency, max_concurrency=2)]) as rs:
        res = score(rs, ["c"] * 8)
    assert res.total == [1.0] * 8
    assert CONCURRENCY["peak"] == 2


def test_rate_limit_spaces_call_starts():
    starts = []

    async def stamp(prompt, completion, **meta):
        starts.append(time.monotonic())
        return 1.0

    with RewardSet([spec(stamp, rate_per_s=10.0)]) as rs:
        res = score(rs, ["a"] * 25)
    assert res.total == [1.0] * 25
    # 10 per second: 25 calls need at least two full periods after the first burst.
    assert max(starts) - min(starts) >= 1.9
    # and no sliding one-second window holds more than 10 starts
    starts.sort()
    assert all(starts[i + 10] - starts[i] > 0.99 for i in range(len(starts) - 10))


def test_timeout_excludes_queueing_for_limits():
    async def slowish(prompt, completion, **meta):
        await asyncio.sleep(0.1)
        return 1.0

    with RewardSet([spec(slowish, max_concurrency=1, timeout_s=0.5)]) as rs:
        res = score(rs, ["a"] * 8)  # 0.8 s in total, each call well inside its timeout
    assert res.total == [1.0] * 8 and not res.failed


# -------------------------------------------------------------------------- loading and config


def test_load_callable_module_and_file_forms():
    assert load_callable("math:sqrt") is math.sqrt
    assert load_callable(f"{HERE}:length_score")("p", "abc") == 3.0


@pytest.mark.parametrize(
    ("path", "exc", "fragment"),
    [
        ("no_colon_here", ValueError, "package.module:attr"),
        ("not_a_module_xyz:f", ImportError, "not_a_module_xyz"),
        ("math:no_such_attr", ImportError, "no_such_attr"),
        ("math:pi", ValueError, "not a function"),
        ("/nonexistent/rewards.py:f", ImportError, "does not exist"),
    ],
)
def test_load_callable_errors_name_the_path(path, exc, fragment):
    with pytest.raises(exc, match=fragment) as info:
        load_callable(path)
    assert path in str(info.value)


def test_validate_specs_fails_fast():
    with pytest.raises(ImportError, match="nope_module"):
        validate_specs([RewardSpec(fn="nope_module:f")])
    with pytest.raises(ValueError, match="duplicate reward name"):
        validate_specs([spec(length_score), spec("length_score")])
    with pytest.raises(ValueError, match="cannot be pickled"):
        validate_specs([spec(lambda p, c, **m: 1.0, executor="process")])
    validate_specs([spec(length_score), spec(length_score, name="again")])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"timeout_s": 0},
        {"executor": "gpu"},
        {"max_concurrency": 0},
        {"rate_per_s": -1.0},
        {"weight": math.nan},
    ],
)
def test_spec_validation(kwargs):
    with pytest.raises(ValueError):
        RewardSpec(fn="math:sqrt", **kwargs)


def test_reward_set_argument_validation():
    with pytest.raises(ValueError, match="on_failure"):
        RewardSet([], on_failure="ignore")


def test_rate_limiter_spaces_entries():
    """The admission/reward throttle (asyncio-throttle) really limits the rate."""
    import time

    from pipeline.producer.rewards.call import rate_limiter

    async def go() -> float:
        limiter = rate_limiter(20.0)
        t0 = time.monotonic()
        for _ in range(30):
            async with limiter:
                pass
        return time.monotonic() - t0

    assert asyncio.run(go()) >= 0.9  # 30 entries at 20/s need >= ~1 s after the first 20
