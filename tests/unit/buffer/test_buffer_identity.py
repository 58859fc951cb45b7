"""ProducerRegistry: who may send what (pure logic; the sockets are in test_buffer_transport)."""

from __future__ import annotations

import logging

from buffer_factories import make_group

from buffer.identity import (
    FROM_EVALUATOR,
    NO_METADATA,
    STALE_INCARNATION,
    UNEXPECTED_PRODUCER,
    UNKNOWN_INCARNATION,
    UNKNOWN_PRODUCER,
    ProducerRegistry,
)
from buffer.protocol import Hello


def hello(pid: str = "p0", inc: str = "p0-a", recovered=()) -> Hello:
    return Hello(
        producer_id=pid, incarnation=inc, policy_version=0, pid=1, recovered=list(recovered)
    )


def group(pid: str = "p0", inc: str | None = "p0-a", seq: object = 0):
    g = make_group(producer_id=pid)
    g.metadata = {} if inc is None else {"incarnation": inc, "seq": seq}
    return g


def test_nothing_is_accepted_before_hello():
    reg = ProducerRegistry()
    assert reg.check_control("p0", "p0-a") == UNKNOWN_PRODUCER
    assert reg.check_group(group()) == UNKNOWN_PRODUCER
    reg.hello(hello())
    assert reg.check_control("p0", "p0-a") is None
    assert reg.check_group(group()) is None


def test_only_the_runs_producer_ids_may_say_hello():
    reg = ProducerRegistry({"p0", "p1"})
    assert reg.check_hello(hello("evil-producer", "x")) == UNEXPECTED_PRODUCER
    assert reg.check_hello(hello("p1", "p1-a")) is None


def test_an_evaluator_may_say_hello_but_sends_no_groups():
    reg = ProducerRegistry({"p0"}, evaluators=frozenset({"eval"}))
    assert reg.check_hello(hello("eval", "eval-a")) is None
    reg.hello(hello("eval", "eval-a"))
    assert reg.check_control("eval", "eval-a") is None  # its EvalResult, heartbeats
    assert reg.check_group(group("eval", "eval-a")) == FROM_EVALUATOR
    assert ProducerRegistry({"p0"}).check_hello(hello("eval", "e")) == UNEXPECTED_PRODUCER


def test_group_needs_incarnation_and_seq():
    reg = ProducerRegistry()
    reg.hello(hello())
    assert reg.check_group(group(inc=None)) == NO_METADATA
    assert reg.check_group(group(seq="3")) == NO_METADATA
    assert reg.check_group(group(seq=-1)) == NO_METADATA
    assert reg.check_group(group(seq=True)) == NO_METADATA
    assert reg.check_group(group(inc="p0-other")) == UNKNOWN_INCARNATION
    assert reg.check_group(group(pid="p1")) == UNKNOWN_PRODUCER


def test_restart_replaces_the_live_incarnation_and_keeps_older_groups():
    reg = ProducerRegistry()
    assert reg.hello(hello()) is True
    assert reg.hello(hello()) is False  # the same process saying Hello again
    assert reg.hello(hello(inc="p0-b", recovered=["p0-dead"])) is True
    assert reg.check_control("p0", "p0-a") == STALE_INCARNATION
    assert reg.check_control("p0", "p0-b") is None
    # Groups of the earlier process still in the socket, and of the log it took over, count.
    for inc in ("p0-a", "p0-b", "p0-dead"):
        assert reg.check_group(group(inc=inc)) is None


def test_rejections_are_counted_and_logged_once_per_producer_and_reason(caplog):
    reg = ProducerRegistry()
    with caplog.at_level(logging.WARNING, logger="buffer.identity"):
        for _ in range(50):
            reg.reject(UNKNOWN_PRODUCER, "evil", "Ack")
        reg.reject(NO_METADATA, "evil", "group")
        reg.reject(UNKNOWN_PRODUCER, "evil2", "Ack")
    assert reg.metrics() == {f"rejected/{NO_METADATA}": 1.0, f"rejected/{UNKNOWN_PRODUCER}": 51.0}
    assert len(caplog.records) == 3
