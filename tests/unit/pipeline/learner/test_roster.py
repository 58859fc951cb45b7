"""The roster's data leases and members (pure logic, with the real ``PromptSource``): every
prompt is read exactly once per epoch across joins, leaves and restarts of producers and of the
learner, and a producer that left stays out after a learner restart."""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import DataConfig
from pipeline.learner.roster import Roster, relaunch
from pipeline.producer.data import PromptSource

RECORDS = [{"prompt": f"q{i}"} for i in range(13)]  # prompt id: the record index
CFG = DataConfig(path="x", seed=3)


class Run:
    """The learner's roster and cursors, and producer processes, as the real ones use them:
    groups reach the learner in order; the learner's cursor of a producer is the highest it
    received (a checkpoint keeps a copy); a new producer process resumes at it."""

    def __init__(self, run_dir: Path, producers: int, chunk: int) -> None:
        self.run_dir, self.chunk = run_dir, chunk
        self.roster = Roster.open(run_dir, producers, chunk)
        self.roster.save()  # the learner writes it as it starts
        self.producers = producers
        self.known: dict[str, int] = {}      # the learner's cursor per producer
        self.procs: dict[str, PromptSource] = {}
        self.in_flight: dict[str, list[tuple[int, int, str]]] = {}
        self.delivered: list[tuple[int, str]] = []  # (position, prompt id) the learner got
        for i in range(producers):
            self.start(f"p{i}")

    def start(self, pid: str) -> None:
        self.procs[pid] = PromptSource(CFG, records=RECORDS)
        self.in_flight[pid] = []
        self.procs[pid].lease(0, [])  # nothing until the first announce
        self._resumed = getattr(self, "_resumed", set()) | {pid}

    def announce(self) -> None:
        self.roster.top_up(self.known)
        self.roster.save()
        wire = self.roster.wire()
        for pid, src in self.procs.items():
            if pid in self._resumed:  # a new process or learner session: the learner's cursor
                src.cursor = max(src.cursor, self.known.get(pid, 0))
            if pid in wire:
                src.lease_from(wire[pid])
        self._resumed = set()

    def read(self, pid: str, n: int) -> None:
        if pid not in self.procs or pid not in self.roster.members or \
                pid in self.roster.leaving:
            return
        for _ in range(n):
            rec = self.procs[pid].take()
            if rec is None:
                return
            self.in_flight[pid].append((rec.cursor, rec.position, rec.prompt_id))

    def deliver(self, pid: str, n: int) -> None:
        for cursor, pos, prompt_id in self.in_flight.get(pid, [])[:n]:
            self.delivered.append((pos, prompt_id))
            self.known[pid] = max(self.known.get(pid, 0), cursor)
        if pid in self.in_flight:
            del self.in_flight[pid][:n]

    def leave(self, pid: str) -> None:
        """Clean leave: every group delivered, then Leave with the exact cursor."""
        if pid not in self.procs or len(self.roster.members) < 2 or \
                pid not in self.roster.members:
            return
        self.deliver(pid, len(self.in_flight[pid]))
        self.roster.leave(pid, self.procs.pop(pid).cursor)
        self.roster.save()  # the learner writes every change before it goes on
        del self.in_flight[pid]

    def kill_producer(self, pid: str) -> None:
        """Killed and restarted by the launcher: what it had in flight is lost."""
        if pid in self.procs:
            self.start(pid)

    def die_while_leaving(self, pid: str) -> None:
        """Said it was leaving, then died: the learner takes it out at its own cursor."""
        if pid not in self.procs or len(self.roster.members) < 2 or \
                pid not in self.roster.members:
            return
        self.roster.mark_leaving(pid)
        self.procs.pop(pid)
        del self.in_flight[pid]
        self.roster.leave(pid, self.known.get(pid, 0))
        self.roster.save()

    def join(self, pid: str) -> None:
        if pid not in self.procs:
            self.start(pid)
            self.roster.join(pid)
            self.roster.save()

    def restart_learner(self) -> None:
        """kill -9: a new learner reads the roster file; producers resend what its checkpoint
        lacks, so its cursors come back to what the old one had."""
        self.roster = Roster.open(self.run_dir, self.producers, self.chunk)
        self._resumed = set(self.procs)

    def relaunch(self, producers: int) -> None:
        """Ctrl-C (every group delivered) and a new launch with --resume."""
        for pid in list(self.procs):
            self.deliver(pid, len(self.in_flight[pid]))
        relaunch(self.run_dir, producers, self.known)
        self.procs.clear()
        self.roster = Roster.open(self.run_dir, producers, self.chunk)
        for i in range(producers):
            self.start(f"p{i}")

    def drain(self, upto: int) -> None:
        """Members read on until every position below ``upto`` has reached the learner."""
        for _ in range(300):
            got = {pos for pos, _ in self.delivered}
            if all(g in got for g in range(upto)):
                return
            self.announce()
            for pid in list(self.procs):
                self.read(pid, 5)
                self.deliver(pid, 5)
        raise AssertionError("the members stopped reading")


OPS = st.one_of(
    st.tuples(st.just("read"), st.integers(0, 3), st.integers(1, 9)),
    st.tuples(st.just("deliver"), st.integers(0, 3), st.integers(1, 9)),
    st.tuples(st.just("announce"), st.just(0), st.just(0)),
    st.tuples(st.just("join"), st.integers(0, 3), st.just(0)),
    st.tuples(st.just("leave"), st.integers(0, 3), st.just(0)),
    st.tuples(st.just("kill_producer"), st.integers(0, 3), st.just(0)),
    st.tuples(st.just("die_while_leaving"), st.integers(0, 3), st.just(0)),
    st.tuples(st.just("restart_learner"), st.just(0), st.just(0)),
    st.tuples(st.just("relaunch"), st.integers(1, 2), st.just(0)),
)


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(OPS, max_size=60), producers=st.integers(1, 2), chunk=st.integers(1, 8))
def test_every_prompt_is_read_once_per_epoch_through_joins_leaves_and_restarts(
        ops, producers, chunk):
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None  # the roster's fsyncs cost nothing
    with tempfile.TemporaryDirectory(dir=shm) as d:
        run = Run(Path(d), producers, chunk)
        for op, k, n in ops:
            if op in ("read", "deliver"):
                getattr(run, op)(f"p{k}", n)
            elif op in ("join", "leave", "kill_producer", "die_while_leaving"):
                getattr(run, op)(f"p{k}")
            elif op == "relaunch":
                run.relaunch(k)
            else:
                getattr(run, op)()
        epochs = run.roster.next_free // len(RECORDS) + 1
        run.drain(epochs * len(RECORDS))
        positions = Counter(pos for pos, _ in run.delivered)
        assert max(positions.values()) == 1, [p for p, c in positions.items() if c > 1]
        for e in range(epochs):  # each epoch: every prompt once
            ids = Counter(i for pos, i in run.delivered if pos // len(RECORDS) == e)
            assert sorted(ids) == sorted(str(i) for i in range(len(RECORDS)))
            assert set(ids.values()) == {1}


def test_a_join_halfway_through_an_epoch_reads_each_prompt_once(tmp_path):
    """The case the old per-shard cursor got wrong: 1,000 prompts, p0 alone reads 500, p1
    joins, both finish the epoch (it read 1,250, 342 twice, and never 92)."""
    records = [{"prompt": f"q{i}", "id": i} for i in range(1000)]
    roster = Roster(1, chunk=16, path=tmp_path / "roster.json")
    srcs = {"p0": PromptSource(DataConfig(path="x", seed=0), records=records)}
    known: dict[str, int] = {}
    read: list[int] = []

    def step(who: list[str]) -> None:
        roster.top_up(known)
        for pid in who:
            srcs[pid].lease_from(roster.wire()[pid])
            for _ in range(8):
                rec = srcs[pid].take()
                if rec is not None and rec.position < 1000:
                    read.append(rec.prompt_id)
                    known[pid] = rec.cursor

    while len(read) < 500:
        step(["p0"])
    roster.join("p1")
    srcs["p1"] = PromptSource(DataConfig(path="x", seed=0), records=records)
    while len(read) < 1000 and roster.next_free < 1100:
        step(["p0", "p1"])
    assert len(read) == 1000 and len(set(read)) == 1000


def test_a_producer_that_left_stays_out_after_a_learner_restart(tmp_path):
    """remove p1, kill -9 the learner: the restarted one has one member, not two, and p1's
    unread lease is leased to p0 first."""
    roster = Roster(2, chunk=4, path=tmp_path / "roster.json")
    roster.top_up({})
    roster.save()
    assert roster.wire() == {"p0": [0, 0, 4], "p1": [0, 4, 8]}
    roster.leave("p1", cursor=1)
    roster.save()
    again = Roster.open(tmp_path, 2, chunk=4)
    assert list(again.members) == ["p0"]
    again.top_up({"p0": 4})
    assert again.wire()["p0"] == [4, 5, 8, 8, 9]  # p1's unread 5..7, then new positions


def test_a_leaving_producer_says_hello_to_a_restarted_learner_and_is_not_added_back(tmp_path):
    roster = Roster(2, chunk=4, path=tmp_path / "roster.json")
    roster.leave("p1", 0)
    assert not roster.join("p1", leaving=True) and list(roster.members) == ["p0"]
    roster.join("p0", leaving=True)  # still a member until its Leave; it gets nothing new
    roster.top_up({})
    assert "p0" in roster.members and roster.leaving == {"p0"} and roster.wire()["p0"] == [0]


def test_a_new_launch_starts_with_its_own_producers(tmp_path):
    roster = Roster(1, chunk=4, path=tmp_path / "roster.json")
    roster.join("p2")
    roster.top_up({})
    roster.save()
    relaunch(tmp_path, 1, {"p2": 1})
    again = Roster.open(tmp_path, 1, chunk=4)
    assert list(again.members) == ["p0"] and again.pool == [[5, 8]]
