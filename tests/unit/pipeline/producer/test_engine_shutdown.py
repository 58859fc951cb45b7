"""A producer's engine shutdown (pure logic, fake engine): the record that tells the console the
errors after it are the shutdown's, and a failing shutdown kept to one warning line."""

from __future__ import annotations

import logging

from pipeline.procs import ENGINE_SHUTDOWN
from pipeline.producer.engine import shutdown_engine


class FakeEngine:
    def __init__(self, error: Exception | None = None):
        self.error, self.calls = error, 0

    def shutdown(self) -> None:
        self.calls += 1
        if self.error is not None:
            raise self.error


def _records(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records]


def test_a_stopped_producer_marks_its_engine_shutdown(caplog):
    caplog.set_level(logging.INFO)
    engine = FakeEngine()
    shutdown_engine(engine, "p0")
    assert engine.calls == 1 and _records(caplog) == [(logging.INFO, f"p0: {ENGINE_SHUTDOWN}")]


def test_a_failing_shutdown_is_one_warning_with_its_traceback_at_info(caplog):
    caplog.set_level(logging.INFO)
    shutdown_engine(FakeEngine(RuntimeError("EngineCore died")), "p0")
    warnings = [m for lvl, m in _records(caplog) if lvl >= logging.WARNING]
    assert warnings == ["p0: the engine's shutdown raised RuntimeError (traceback in this "
                        "process's log file)"]
    assert any(r.exc_info and r.levelno == logging.INFO for r in caplog.records)


def test_a_failed_producer_does_not_mark_its_shutdown(caplog):
    # Its traceback and the engine's errors then reach the console (pipeline.launch.console).
    caplog.set_level(logging.INFO)
    shutdown_engine(FakeEngine(), "p0", failed=True)
    assert not [m for _, m in _records(caplog) if ENGINE_SHUTDOWN in m]
