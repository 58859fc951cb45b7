"""``pipeline.launch.local._stop`` signals a child once: its process group, or the process alone
when it has no group yet. The signal calls are replaced by recorders (pure logic): a learner that
got SIGINT twice (group, then process) took the second as "stop now" and lost its final
checkpoint."""

from __future__ import annotations

import signal
from types import SimpleNamespace

from pipeline.launch import local


def _recorder(monkeypatch, group_fails: bool = False) -> list[tuple[str, int, int]]:
    calls: list[tuple[str, int, int]] = []

    def killpg(pid, sig):
        calls.append(("killpg", pid, sig))
        if group_fails:
            raise ProcessLookupError(pid)

    monkeypatch.setattr(local.os, "killpg", killpg)
    monkeypatch.setattr(local.os, "kill", lambda pid, sig: calls.append(("kill", pid, sig)))
    return calls


def test_a_child_with_a_group_gets_the_signal_once_through_it(monkeypatch):
    calls = _recorder(monkeypatch)
    local._stop(SimpleNamespace(pid=42), signal.SIGINT)
    assert calls == [("killpg", 42, signal.SIGINT)]


def test_a_child_without_a_group_yet_gets_it_alone(monkeypatch):
    calls = _recorder(monkeypatch, group_fails=True)
    local._stop(SimpleNamespace(pid=42), signal.SIGINT)
    assert calls == [("killpg", 42, signal.SIGINT), ("kill", 42, signal.SIGINT)]


def test_group_false_signals_the_process_alone(monkeypatch):
    calls = _recorder(monkeypatch)
    local._stop(SimpleNamespace(pid=42), signal.SIGTERM, group=False)
    assert calls == [("kill", 42, signal.SIGTERM)]


def test_a_child_not_started_is_not_signalled(monkeypatch):
    calls = _recorder(monkeypatch)
    local._stop(SimpleNamespace(pid=None), signal.SIGINT)
    assert calls == []
