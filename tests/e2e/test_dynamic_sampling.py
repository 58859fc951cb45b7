"""Dynamic sampling on a real run (launcher, vLLM CPU engine, tiny model): a reward constant for
about half the prompts; the producer drops those groups before sending them, counts them in
metrics.jsonl, and conservation stays exact with them (``bench.soak.tally``)."""

from __future__ import annotations

import json
import zlib

import pytest

from bench.soak import tally
from tests.e2e.support.launcher import read_metrics
from tests.e2e.support.train_run import pipeline_train, tiny_args

pytestmark = pytest.mark.slow


def test_zero_variance_groups_are_dropped_counted_and_conserved(tiny_model, tmp_path):
    run_dir = tmp_path / "dynamic"
    steps = 4
    pipeline_train(*tiny_args(tiny_model, run_dir), "--reward",
                   "tests.e2e.support.sampling_rewards:half_constant", "--mode", "async",
                   "--max-staleness", "1", "--steps", str(steps), "--tensorboard", "false",
                   "--generation.dynamic_sampling", "true", tag=run_dir.name)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    last = rows[-1]
    dropped = last["producer/groups_dropped_zero_variance"]
    assert dropped > 0 and last["by_producer/p0/groups_dropped_zero_variance"] == dropped
    assert last["producer/dynamic_sampling_cap_hits"] == 0
    # No trained group was uninformative: each batch was refilled in their place.
    assert all(r["degenerate_frac"] == 0 for r in rows), [r["degenerate_frac"] for r in rows]

    # The producer's sent log names each dropped group; the constant prompts are among them.
    records = [json.loads(x) for f in (run_dir / "producers").glob("*.jsonl")
               for x in f.read_text().splitlines() if x.strip()]
    constant = [r["prompt_id"] for r in records if "dropped_zero_variance" in r]
    assert any(zlib.crc32(p.encode()) % 2 == 0 for p in constant), constant

    # Conservation, exact: generated = trained + dropped (by reason) + rejected + held.
    t = tally(run_dir)
    assert t["lost"] == 0 and t["conservation_ok"] and t["buffer_invariant_ok"], t
    assert t["dropped_zero_variance"] == len(constant) >= dropped  # heartbeats may lag the log
    assert t["generated"] == t["produced"] + t["dropped_zero_variance"] + t["dropped_by_reward"]
    assert t["trained"] == 2 * steps, t
