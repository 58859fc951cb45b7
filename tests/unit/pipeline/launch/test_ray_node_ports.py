"""The worker-port range a RayNode asks for never holds one of its component ports (pure logic;
``ray start`` exits when it does)."""

import random

import pytest

from pipeline.launch.ray_node import worker_range


def test_range_excludes_every_component_port():
    rng = random.Random(0)
    for _ in range(5000):
        taken = rng.sample(range(10002, 65536), 8)
        low, high = worker_range(taken)
        assert high - low + 1 == 101
        assert low >= 10002 and high <= 65535
        assert not any(low <= p <= high for p in taken)


def test_the_collision_seen_in_ci_cannot_recur():
    # runtime_env_agent 37757 fell inside a range centred on another port (37745..37845)
    taken = [56271, 34957, 49841, 37925, 48099, 55989, 37757, 55341, 37795]
    low, high = worker_range(taken)
    assert not any(low <= p <= high for p in taken)


def test_no_room_is_a_clear_error():
    with pytest.raises(RuntimeError, match="worker ports"):
        worker_range(list(range(10002, 65536, 100)))
