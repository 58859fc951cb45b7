"""Conservation soak: a long CPU run whose producers and learner are killed (-9) along the way.

``python -m bench.soak --minutes 30`` runs `pipeline-train` on the tiny model with 2
producers, kills a producer every few minutes (the launcher restarts it) and the learner once
(the launcher restarts it from its last checkpoint while producers keep running and resend what
that checkpoint lacks), stops the run, and then checks from the counters that

    groups produced = trained + dropped as stale + dropped by capacity + rejected + held

where *produced* is every group a producer handed to its socket (``run_dir/producers/*.jsonl``)
minus those a killed producer had not delivered and that still wait in its outbox log for a
successor to resend (reported as pending), with nothing lost; and that no group was trained
twice. Groups a producer generated but never sent are in the same logs under their reason (a
failed reward or episode, ``dropped_by_reward``; an uninformative group under
``generation.dynamic_sampling``, ``dropped_zero_variance``; one begun before a learner restart
to an older checkpoint and finished after it, ``dropped_restart``), so every group whose
generation ended is accounted for:

    generated = produced + dropped by reward + dropped as zero-variance + dropped at a restart

``--elastic`` starts one producer of at most two instead: the second joins at a fifth of the
run (``pipeline-train scale --producers 2``), the first leaves half way (``--remove p0``), and the
learner is killed at 70%; ``prompts_duplicated`` counts the prompts (positions of the run's
sequence) whose group was sent twice. Prints a table and writes ``run_dir/soak.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from buffer.ledger import GroupLedger
from buffer.store import RolloutBuffer
from pipeline.learner.checkpoint import latest_checkpoint, load_checkpoint
from pipeline.producer.outbox import read_log

PRODUCER_RE = re.compile(r"producer (p\d+) \(pid (\d+)[^)]*\) connected")
LEARNER_RE = re.compile(r"learner pid (\d+)")


def _watch(stream, log_path: Path, pids: dict[str, int]) -> None:
    with log_path.open("a") as log:
        for line in stream:
            log.write(line)
            if m := PRODUCER_RE.search(line):
                pids[m.group(1)] = int(m.group(2))
            elif m := LEARNER_RE.search(line):
                pids["learner"] = int(m.group(1))


def _kill(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


@dataclass
class ProducerRecords:
    """What the producers' own files say they generated: the seqs of their groups per
    incarnation, how many groups were sent per position of the prompt sequence, and the groups
    ended without a send, by reason."""
    produced: dict[str, set[int]] = field(default_factory=dict)
    positions: dict[int, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_RECORDS, 0))
    in_outbox: set[tuple[str, int]] = field(default_factory=set)


DROP_RECORDS = ("dropped_by_reward", "dropped_zero_variance", "dropped_restart")


def producer_records(producers_dir: Path) -> ProducerRecords:
    """Read every sent log (``*.jsonl``) and outbox log (``*.wal``) under ``producers_dir``.

    A group goes to the outbox log before it is sent and to the sent log after: a producer
    killed (or stopped) between the two sent a group that only its outbox log records, so a
    group counts as generated when either file has it."""
    rec = ProducerRecords()

    def count(inc: str, seq: int, position) -> None:
        seqs = rec.produced.setdefault(inc, set())
        if seq not in seqs and isinstance(position, int) and position >= 0:
            rec.positions[position] = rec.positions.get(position, 0) + 1
        seqs.add(seq)

    for f in sorted(producers_dir.glob("*.jsonl")):
        rec.produced.setdefault(f.stem, set())
        for line in f.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if "seq" in row:
                count(f.stem, int(row["seq"]), row.get("position"))
            else:
                for reason in DROP_RECORDS:
                    if reason in row:
                        rec.dropped[reason] += 1
    for f in sorted(producers_dir.glob("*.wal")):
        for g in read_log(f):
            inc, seq = str(g.metadata["incarnation"]), int(g.metadata["seq"])
            rec.in_outbox.add((inc, seq))
            count(inc, seq, g.metadata.get("position"))
    return rec


def tally(run_dir: Path) -> dict[str, float]:
    """Conservation from the run's own records (pure reading, no processes)."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise SystemExit(f"no checkpoint under {run_dir}")
    state, _tensors, buf_bytes = load_checkpoint(ckpt)
    buf = RolloutBuffer.restore(buf_bytes, capacity=10**9, max_staleness=None)
    st = buf.stats
    ledger = GroupLedger.from_dict(state.ledger)
    records = producer_records(run_dir / "producers")
    produced, positions, in_outbox = records.produced, records.positions, records.in_outbox
    dropped_by_reward = records.dropped["dropped_by_reward"]
    dropped_zero_variance = records.dropped["dropped_zero_variance"]
    dropped_restart = records.dropped["dropped_restart"]
    n_produced = sum(len(s) for s in produced.values())
    accepted = {inc: ledger.accepted(inc) for inc in produced}
    missing = {(i, q) for i in produced for q in produced[i] - accepted[i]}
    # Groups a killed producer had not delivered sit in its outbox log until a successor (or a
    # --resume) resends them: pending, not lost.
    pending = len(missing & in_outbox)
    lost = len(missing - in_outbox)
    unknown = sum(len(ledger.accepted(i)) for i in ledger.streams if i not in produced)
    return {
        "incarnations": len(produced),
        "generated": n_produced + dropped_by_reward + dropped_zero_variance + dropped_restart,
        "produced": n_produced,
        "dropped_by_reward": dropped_by_reward,
        "dropped_zero_variance": dropped_zero_variance,
        "dropped_restart": dropped_restart,
        "received_unique": st.received,
        "trained": st.served,
        "dropped_stale": st.dropped_stale,
        "dropped_capacity": st.dropped_capacity,
        "held": st.size,
        "rejected_groups": sum(st.rejected_groups.values()),
        "duplicates_ignored": ledger.duplicates,
        "pending_in_outbox_logs": pending,
        "lost": lost,
        # A prompt (a position of the run's sequence, ``pipeline.learner.roster``) whose group
        # two producers, or two processes of one, sent: read twice.
        "prompts_sent": len(positions),
        "prompts_duplicated": sum(1 for n in positions.values() if n > 1),
        "accepted_without_producer_record": unknown,
        "frames_rejected": st.rejected,
        "buffer_invariant_ok": st.received == st.served + st.dropped_stale
        + st.dropped_capacity + sum(st.rejected_groups.values()) + st.size,
        # generated = trained + dropped (by reason, at either side) + rejected + held
        "conservation_ok": lost == 0 and n_produced + dropped_by_reward + dropped_zero_variance
        - pending == st.served + st.dropped_stale + st.dropped_capacity + dropped_by_reward
        + dropped_zero_variance + sum(st.rejected_groups.values()) + st.size,
        "steps": state.step,
        "version": state.version,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--producer-kill-every", type=float, default=4.0, help="minutes")
    ap.add_argument("--learner-kill-at", type=float, default=None,
                    help="minute of the learner kill (default: half way)")
    ap.add_argument("--run-dir", default="runs/soak")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--elastic", action="store_true",
                    help="one producer of two: a join, a leave of p0, then the learner kill")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    if run_dir.exists() and any(run_dir.iterdir()):
        raise SystemExit(f"{run_dir} is not empty; pick a new --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pipeline.launch.cli", "--model", args.model,
           "--data", "arithmetic:100000", "--reward", "pipeline.tasks.rewards:length_reward",
           *(["--num-producers", "1", "--max_producers", "2"] if args.elastic else
             ["--num-producers", "2"]), "--mode", "async", "--max-staleness", "2",
           "--batch-groups", "4", "--group-size", "4", "--max-tokens", "16",
           "--steps", "1000000", "--run-dir", str(run_dir), "--tensorboard", "false",
           "--engine.max_model_len", "256", "--engine.cpu_kvcache_space_gib", "1",
           "--train.checkpoint_every", "1", "--max-producer-restarts", "1000",
           "--max-learner-restarts", "10", "--verbose"]  # _watch reads the INFO lines
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1)
    pids: dict[str, int] = {}
    threading.Thread(target=_watch, args=(launcher.stdout, run_dir / "soak.log", pids),
                     daemon=True).start()
    rng = random.Random(args.seed)
    start = time.monotonic()
    learner_at = 60 * (args.learner_kill_at if args.learner_kill_at is not None
                       else args.minutes * (0.7 if args.elastic else 0.5))
    scales = [(0.2 * 60 * args.minutes, ["--producers", "2"]),
              (0.5 * 60 * args.minutes, ["--remove", "p0"])] if args.elastic else []
    next_producer_kill = 60 * args.producer_kill_every
    kills = {"producer": 0, "learner": 0}
    learner_killed = False
    while (elapsed := time.monotonic() - start) < 60 * args.minutes:
        if launcher.poll() is not None:
            raise SystemExit(f"launcher exited early ({launcher.returncode}); see "
                             f"{run_dir / 'soak.log'}")
        if scales and elapsed >= scales[0][0]:
            _, what = scales.pop(0)
            done = subprocess.run([sys.executable, "-m", "pipeline.launch.cli", "scale",
                                   str(run_dir), *what], capture_output=True, text=True)
            print(f"[soak] {elapsed / 60:5.1f} min: scale {' '.join(what)} -> "
                  f"{done.returncode} {done.stderr.strip()}", flush=True)
        if not learner_killed and elapsed >= learner_at:
            learner_killed = _kill(pids.get("learner"))
            kills["learner"] += learner_killed
            print(f"[soak] {elapsed / 60:5.1f} min: kill -9 learner -> {learner_killed}",
                  flush=True)
        if elapsed >= next_producer_kill:
            name = rng.choice([p for p in pids if p.startswith("p")] or ["p0"])
            ok = _kill(pids.get(name))
            kills["producer"] += ok
            print(f"[soak] {elapsed / 60:5.1f} min: kill -9 producer {name} -> {ok}", flush=True)
            next_producer_kill += 60 * args.producer_kill_every
        time.sleep(1.0)
    launcher.send_signal(signal.SIGINT)  # final checkpoint, clean stop
    launcher.wait(timeout=300)
    result = tally(run_dir) | {f"{k}_kills": v for k, v in kills.items()}
    result["minutes"] = args.minutes
    (run_dir / "soak.json").write_text(json.dumps(result, indent=2))
    for k, v in result.items():
        print(f"{k:>36}: {v}")
    return 0 if result["conservation_ok"] and result["buffer_invariant_ok"] and \
        not result["prompts_duplicated"] else 1


if __name__ == "__main__":
    sys.exit(main())
