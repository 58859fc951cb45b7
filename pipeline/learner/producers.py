"""What the learner knows of each producer (from its Hello and heartbeats), and when one counts
as alive: heard from within ``ALIVE_S``. A producer not alive gets no GPU copy of a version and
no NCCL link kept up, and training does not wait for its ack."""

from __future__ import annotations

from dataclasses import dataclass, field

ALIVE_S = 10.0  # a producer silent for longer is reported as not alive


@dataclass
class ProducerInfo:
    pid: int = 0
    version: int = 0
    last_seen: float = -ALIVE_S  # not alive until heard from after its Hello
    stats: dict[str, float] = field(default_factory=dict)  # its last heartbeat's
    carried: dict[str, float] = field(default_factory=dict)  # its earlier processes' counters
    devices: list[str] = field(default_factory=list)  # GPU UUID per vLLM worker ([] = CPU)
    route: str = "file"  # weight route for this producer (sync.routes)

    def alive(self, now: float) -> bool:
        return now - self.last_seen < ALIVE_S
