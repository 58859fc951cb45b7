"""How the suite is spread over pytest-xdist workers (tests/suite_order.py): pure logic."""

from __future__ import annotations

import suite_order
import time_budget
from suite_order import Entry


def test_files_and_ray_tests_are_groups():
    assert suite_order.group_of(Entry("tests/e2e/test_a.py::test_x[p]")) == "tests/e2e/test_a.py"
    assert suite_order.group_of(Entry("tests/e2e/test_a.py::test_x[ray]", ray=True)) == "ray"


def test_costliest_groups_first_each_in_collected_order(monkeypatch):
    monkeypatch.setattr(time_budget, "OVER", {"tests/e2e/test_b.py::test_long": (500.0, "why")})
    entries = [Entry("tests/unit/test_u.py::test_1"),
               Entry("tests/e2e/test_a.py::test_1"),
               Entry("tests/e2e/test_b.py::test_long"),
               Entry("tests/e2e/test_a.py::test_2"),
               Entry("tests/e2e/test_c.py::test_ray", ray=True),
               Entry("tests/e2e/test_d.py::test_ray", ray=True),
               Entry("tests/e2e/test_gpu.py::test_1", skipped=True),
               Entry("tests/e2e/test_gpu.py::test_2", skipped=True)]
    got = [entries[i].nodeid for i in suite_order.order(entries)]
    assert got == ["tests/e2e/test_b.py::test_long",  # 500
                   "tests/e2e/test_a.py::test_1", "tests/e2e/test_a.py::test_2",  # 240, first
                   "tests/e2e/test_c.py::test_ray", "tests/e2e/test_d.py::test_ray",  # 240
                   "tests/unit/test_u.py::test_1",
                   "tests/e2e/test_gpu.py::test_1", "tests/e2e/test_gpu.py::test_2"]  # skipped: 0


def test_an_exclusive_group_goes_first_with_half_the_unit_tests_beside_it(monkeypatch):
    """While the exclusive test holds the machine alone, the other worker has unit tests to run
    (they take no hold); the other half of them still fill the end."""
    monkeypatch.setattr(time_budget, "OVER", {})
    entries = [Entry("tests/unit/test_u1.py::test_1"),
               Entry("tests/e2e/test_a.py::test_1"),
               Entry("tests/unit/test_u2.py::test_1"), Entry("tests/unit/test_u2.py::test_2"),
               Entry("tests/e2e/test_x.py::test_alone", exclusive=True),
               Entry("tests/unit/test_u3.py::test_1"),
               Entry("tests/e2e/test_c.py::test_ray", ray=True)]
    got = [entries[i].nodeid for i in suite_order.order(entries)]
    assert got == ["tests/e2e/test_x.py::test_alone",
                   "tests/unit/test_u2.py::test_1", "tests/unit/test_u2.py::test_2",  # half
                   "tests/e2e/test_a.py::test_1", "tests/e2e/test_c.py::test_ray",
                   "tests/unit/test_u1.py::test_1", "tests/unit/test_u3.py::test_1"]
    # Without an exclusive test: the order by cost alone.
    plain = [e for e in entries if not e.exclusive]
    assert [plain[i].nodeid for i in suite_order.order(plain)][:2] == [
        "tests/e2e/test_a.py::test_1", "tests/e2e/test_c.py::test_ray"]


def test_an_exclusive_hold_waits_for_the_shared_ones(tmp_path):
    """Real flock on a file: a shared holder in another thread; exclusive waits for its release."""
    import threading

    import machine_share

    lock = tmp_path / "lock"
    held, release = threading.Event(), threading.Event()

    def shared():
        with machine_share.hold(False, lock):
            held.set()
            release.wait(10)

    t = threading.Thread(target=shared)
    t.start()
    held.wait(10)
    with machine_share.hold(False, lock) as waited:  # shared with a shared holder: no wait
        assert waited < 0.5
    threading.Timer(0.5, release.set).start()
    with machine_share.hold(True, lock) as waited:
        assert waited >= 0.4
    t.join(10)
