"""Helpers shared by the learner's socket tests (named so: a real Learner on the tiny model, its
loops on real sockets, and a producer's Hello as the tests send it)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from buffer.protocol import Hello
from buffer.transport import LearnerEndpoint
from pipeline.config import load_config
from pipeline.launch.derive import resolve
from pipeline.learner.loop import Learner


def make_learner(tmp_path: Path, model: Path, **overrides) -> Learner:
    """A Learner of ``model`` for a one-producer run in ``tmp_path``, quiet (no progress line, no
    TensorBoard); ``overrides`` are dotted config keys. Its config is resolved, as the launcher
    resolves a run's."""
    cfg = resolve(load_config(
        overrides={
            "run_dir": str(tmp_path),
            "model.path": str(model),
            "num_producers": 1,
            "progress": False,
            "tensorboard": False,
            **overrides,
        }
    ))
    return Learner(cfg, str(model))


def hello(producer_id: str = "p0", incarnation: str = "p0-1") -> Hello:
    return Hello(producer_id=producer_id, incarnation=incarnation, policy_version=0, pid=1)


class Running:
    """A Learner whose receive and control loops run on real sockets (no training)."""

    def __init__(self, learner: Learner):
        self.learner = learner
        self.tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> Running:
        lr = self.learner
        lr.endpoint = lr.control.endpoint = LearnerEndpoint(lr.cfg.bind_addr)
        self.tasks = [asyncio.create_task(lr._receive()), asyncio.create_task(lr.control.serve())]
        return self

    async def __aexit__(self, *exc) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.learner.endpoint.close()
