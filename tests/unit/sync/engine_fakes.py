"""A stand-in for vLLM's engine in unit tests of pure swap logic (named so: a mock, never in a
test that claims end-to-end behaviour): it records each worker RPC with whether the engine was
paused, and fails the RPCs named in ``fail``."""

from __future__ import annotations


class MockEngine:
    """Pause/resume recorder whose collective_rpc fails the GPU-transport methods on demand."""

    def __init__(self, fail: set[str] = frozenset()):
        self.fail, self.calls, self.paused = set(fail), [], False

    async def pause_generation(self, *, mode: str = "keep", clear_cache: bool = False) -> None:
        self.paused = True

    async def resume_generation(self) -> None:
        self.paused = False

    async def collective_rpc(self, method: str, args: tuple = ()):
        self.calls.append((method, self.paused))
        if method in self.fail:
            raise RuntimeError(f"mock {method} failed")
        if method == "sync_nccl_receive":
            return [{"receive_s": 0.01}]
        return [{}]
