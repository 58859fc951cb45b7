"""Shared fixtures: the tiny random model, vLLM CPU settings, and a child-process leak check."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import psutil
import pytest

# The CPU build of vLLM sizes its KV cache from this (GiB); tests keep it small.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and os.path.exists("/dev/nvidia0")


def pytest_itemcollected(item):
    """Each test's ``xdist_group`` (tests/suite_order.py), marked as it is collected: before
    pytest-xdist's worker reads the groups into the test ids."""
    if item.config.pluginmanager.hasplugin("xdist"):
        import suite_order

        item.add_marker(pytest.mark.xdist_group(suite_order.group_of(_entry(item))))


def _entry(item):
    import suite_order

    skipped = item.get_closest_marker("skip") is not None  # GPU tests: marked below first
    return suite_order.Entry(item.nodeid.split("@", 1)[0],
                             ray=item.get_closest_marker("ray") is not None, skipped=skipped,
                             exclusive=item.get_closest_marker("exclusive") is not None)


def pytest_collection_modifyitems(config, items):
    if not _has_gpu():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the device tool, see README)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    if config.pluginmanager.hasplugin("xdist"):  # the costliest groups first
        import suite_order

        order = suite_order.order([_entry(item) for item in items])
        items[:] = [items[i] for i in order]


@pytest.fixture(autouse=True)
def _machine_share(request):
    """An end-to-end test holds the machine shared, an ``exclusive`` one alone (machine_share)."""
    import machine_share

    if not machine_share.holds_machine(request.node.nodeid):
        yield
        return

    exclusive = request.node.get_closest_marker("exclusive") is not None
    with machine_share.hold(exclusive) as waited:
        # Not the test's own time: the time budget (below) leaves it out.
        request.node.user_properties.append(("machine_wait_s", waited))
        if waited > 1:
            print(f"waited {waited:.0f} s for the machine ({'alone' if exclusive else 'shared'})")
        yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A random-init 2-layer Qwen2 (head_dim 64) with a byte-level tokenizer, built once."""
    from pipeline.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


def live_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]


def assert_no_children(timeout: float = 15.0) -> None:
    """Every child process (vLLM engine cores, workers) has exited."""
    _gone, alive = psutil.wait_procs(live_children(), timeout=timeout)
    alive = [p for p in alive if "resource_tracker" not in " ".join(p.cmdline())]
    assert not alive, f"child processes left behind: {[(p.pid, p.name()) for p in alive]}"


def assert_no_process_left(tag: str) -> None:
    """No process that inherited ``PIPELINE_TEST_RUN=tag`` (a launcher's children, vLLM engine
    cores and workers) is still alive."""
    def tagged(p: psutil.Process) -> bool:
        try:
            return p.environ().get("PIPELINE_TEST_RUN") == tag
        except (psutil.Error, OSError):
            return False

    _gone, alive = psutil.wait_procs([p for p in psutil.process_iter() if tagged(p)], timeout=10)
    assert not alive, f"processes left behind: {[(p.pid, p.name()) for p in alive]}"


# ---- the suite's time budget (tests/time_budget.py) ----------------------------------------

def pytest_addoption(parser):
    parser.addoption("--no-time-budget", action="store_true",
                     help="report tests over their time budget without failing the run")


_TOOK: dict[str, float] = {}
_CPU: dict[str, float] = {}


def _cpu_s() -> float:
    """CPU seconds of this process and of every child it reaped (theirs include their own)."""
    import resource

    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The teardown report carries the test's CPU seconds (setup, call and teardown) to the
    run's budget check, which under pytest-xdist runs in the controller."""
    outcome = yield
    if call.when == "teardown" and hasattr(item, "_cpu_at_start"):
        outcome.get_result().user_properties.append(("cpu_s", _cpu_s() - item._cpu_at_start))


def pytest_runtest_logreport(report):
    took = report.duration
    if report.when == "setup":  # waiting for an exclusive test (tests/machine_share.py)
        took -= sum(v for k, v in report.user_properties if k == "machine_wait_s")
    _TOOK[report.nodeid] = _TOOK.get(report.nodeid, 0.0) + took
    if report.when == "teardown":
        for key, value in report.user_properties:
            if key == "cpu_s":
                _CPU[report.nodeid] = value


def _share(config) -> int:
    """How many tests run at once: pytest-xdist's workers, or 1."""
    workers = config.getoption("numprocesses", None) if config.pluginmanager.hasplugin(
        "xdist") else None
    return workers if isinstance(workers, int) and workers > 1 else 1


def _budget_report(config, over) -> list[str]:
    """The run's budget failures: the tests of ``over`` that fail, and stale ``OVER`` entries."""
    import time_budget

    lines = [f"{o.nodeid}: {o.took_s:.1f} s, budget {o.budget_s:.0f} s"
             + (f" ({o.cpu_s:.1f} CPU-s)" if o.cpu_s is not None else "")
             for o in over if o.fails]
    if config.getoption("-k") or config.getoption("-m") or config.args != ["tests"]:
        return lines  # a partial run: stale OVER entries cannot be told from deselected ones
    # Under pytest-xdist the controller collects nothing: every test it ran reported.
    collected = getattr(config, "_budget_collected", set()) or set(_TOOK)
    lines += [f"{name}: listed in tests/time_budget.py OVER but no such test"
              for name in time_budget.stale_entries(collected)]
    return lines


def pytest_collection_finish(session):
    session.config._budget_collected = {item.nodeid for item in session.items}


def pytest_sessionfinish(session, exitstatus):
    import time_budget

    over = time_budget.over_wall_budget(_TOOK, _share(session.config), _CPU)
    lines = _budget_report(session.config, over)
    session.config._budget_lines = lines
    session.config._budget_slowed = [
        f"{o.nodeid}: {o.took_s:.1f} s, budget {o.budget_s:.0f} s, {o.cpu_s:.1f} CPU-s"
        for o in over if not o.fails]
    if lines and exitstatus == 0 and not session.config.getoption("--no-time-budget"):
        session.exitstatus = 1


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``PIPELINE_TEST_CPU_LOG=FILE``, one JSON line per test: its worker, start time, wall
    seconds and the CPU seconds of this process and of every child it reaped (where the suite's
    CPU time goes, and when each worker was busy)."""
    item._cpu_at_start = _cpu_s()  # for the time budget (pytest_runtest_makereport)
    path = os.environ.get("PIPELINE_TEST_CPU_LOG")
    if not path:
        yield
        return
    import json
    import time

    t0, started = time.monotonic(), time.time()
    yield
    row = {"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
           "start": round(started, 1), "wall_s": round(time.monotonic() - t0, 1),
           "cpu_s": round(_cpu_s() - item._cpu_at_start, 1)}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = getattr(config, "_budget_lines", [])
    if lines:
        terminalreporter.section("time budget (tests/time_budget.py)", red=True)
        for line in lines:
            terminalreporter.write_line(line)
    slowed = getattr(config, "_budget_slowed", [])
    if slowed:
        terminalreporter.section("over the wall budget, within the CPU budget: a slow machine "
                                 "(not failing)")
        for line in slowed:
            terminalreporter.write_line(line)
