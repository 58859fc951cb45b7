"""pipeline-grpo: asynchronous pipelined GRPO.

Layers, each importing only those below it: ``launch`` (CLI, local supervisor) -> ``producer`` |
``learner`` -> ``buffer``, ``sync``; ``config``, ``models`` and ``procs`` are shared by all roles,
``tasks`` holds the built-in prompts and rewards. The reward API is re-exported here:
``from pipeline import reward`` (imported on first use, so ``import pipeline`` stays cheap).
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "reward":
        from pipeline.producer.rewards.loading import reward

        return reward
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
