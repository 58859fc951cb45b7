"""Multi-host roles as separate launchers: `pipeline-train --role learner` bound on TCP, and two
`pipeline-train --role producer --connect HOST:PORT --producer-index k` (real vLLM CPU engines),
each with its own run_dir as on its own node. Producer 0 reads the snapshots from a shared
--sync.snapshot_dir; producer 1 streams every version from the learner's snapshot server
(--sync.serve_stream on the learner, --sync.stream_from on the producer), as a node without the
shared filesystem would.

The learner binds all interfaces with CURVE keys (--curve-keys); producers hold a copy of only
the public server key and the client pair. (The bind-address checks are covered without engines
in tests/unit/pipeline/launch/test_cli.py, the key files in tests/unit/buffer/test_buffer_keys.py.)
"""

from __future__ import annotations

import json
import shutil
import time

import pytest
from conftest import assert_no_process_left

from buffer.keys import generate_curve_keys
from buffer.ports import free_port, free_tcp_port_pair
from buffer.store import RolloutBuffer
from tests.e2e.support.launcher import Launcher, assert_gone, read_metrics

pytestmark = pytest.mark.slow


def test_learner_and_two_producer_launchers_over_tcp(tiny_model, tmp_path, monkeypatch):
    tag = f"roles{time.time_ns()}"
    monkeypatch.setenv("PIPELINE_TEST_RUN", tag)  # inherited by every launcher and its children
    port = free_tcp_port_pair()
    stream_port = free_port("127.0.0.1")
    steps = 3
    # Sync mode: every producer loads every version before the next step, so producer 1 streams
    # at least two of them (v1, v2) whatever the timing.
    common = ("--mode", "sync", "--steps", str(steps),
              "--sync.snapshot_dir", str(tmp_path / "shared_snapshots"))
    learner_dir = tmp_path / "learner"
    # Encrypted and authenticated as across real nodes: the learner binds every interface with
    # CURVE keys; each producer node holds a copy of only the public server key + client pair.
    keys = tmp_path / "learner_keys"
    generate_curve_keys(keys)
    node_keys = tmp_path / "node_keys"
    node_keys.mkdir()
    for name in ("server.key", "client.key", "client.key_secret"):
        shutil.copy(keys / name, node_keys / name)
    # Producers first, as an operator would start remote nodes; their sockets connect before the
    # learner binds. The learner starts once both engines are up, so both producers' groups
    # reach its 3 short steps (a learner started first could fill them from whichever engine
    # came up first).
    producers = [Launcher(tiny_model, tmp_path / f"producer{k}", *common, "--role", "producer",
                          "--connect", f"127.0.0.1:{port}", "--producer-index", str(k),
                          "--curve-keys", str(node_keys),
                          *(["--sync.stream_from", f"tcp://127.0.0.1:{stream_port}"] if k else []))
                 for k in range(2)]
    everyone = list(producers)
    try:
        for k, p in enumerate(producers):
            p.wait_for(lambda p=p: any("engine ready" in ln for ln in list(p.lines)), 600,
                       f"producer {k}'s engine")
        learner = Launcher(tiny_model, learner_dir, *common, "--role", "learner",
                           "--addr", f"tcp://0.0.0.0:{port}", "--curve-keys", str(keys),
                           "--sync.serve_stream", f"tcp://0.0.0.0:{stream_port}")
        everyone.append(learner)
        assert learner.wait(480) == 0, learner.tail()
        finished_at = time.monotonic()
        # Producers learn from the learner's last announce that the run is over, and exit 0.
        for k, p in enumerate(producers):
            left = max(1.0, 90 - (time.monotonic() - finished_at))
            assert p.wait(left) == 0, f"producer {k}:\n{p.tail()}"
        exit_s = time.monotonic() - finished_at
    finally:
        for la in everyone:
            la.stop()
    print(f"producers exited {exit_s:.1f}s after the learner")

    rows = read_metrics(learner_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["staleness_max"] == 0 for r in rows)  # sync mode stays on-policy
    assert rows[-1]["dropped_stale"] == 0
    assert max(r["producers_alive"] for r in rows) == 2  # both producers' heartbeats arrived
    assert (learner_dir / "reward.png").is_file()  # the learner's end-of-run summary
    # Producer 1's versions came over the learner's snapshot server, encrypted (CURVE keys).
    assert sum(r.get("stream_bytes", 0) for r in rows) > 0, rows
    assert "weights streamed from tcp://127.0.0.1:" in "\n".join(producers[1].lines)
    assert "weights streamed from" not in "\n".join(producers[0].lines)

    # Trained groups per producer = received - still held in the final checkpoint's buffer.
    ckpt = learner_dir / "checkpoints" / f"step_{steps}"
    state = json.loads((ckpt / "state.json").read_text())
    held = RolloutBuffer.restore((ckpt / "buffer.msgpack").read_bytes(), 10_000, None
                                 ).held_by_producer()
    trained = {p: n - held.get(p, 0) for p, n in state["received"].items()}
    assert sorted(trained) == ["p0", "p1"] and all(n >= 1 for n in trained.values()), trained
    assert sum(trained.values()) == 2 * steps  # batch_groups x steps, all trained

    for k, p in enumerate(producers):
        log = "\n".join(p.lines)
        assert "trained its last step" in log, log[-3000:]
        # Each producer's own record of what it sent covers what the learner got from it.
        sent = sum(len(f.read_text().splitlines())
                   for f in (tmp_path / f"producer{k}" / "producers").glob("*.jsonl"))
        assert sent >= state["received"][f"p{k}"], (k, sent, state["received"])
        assert not (tmp_path / f"producer{k}" / "metrics.jsonl").exists()  # learner-only output

    for la in everyone:
        log = "\n".join(la.lines)
        assert "Traceback" not in log, log[-3000:]
        assert_gone(la.descendants, "launcher children")
    assert_no_process_left(tag)
