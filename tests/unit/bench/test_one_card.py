"""bench.one_card: the one-card table from gpu_bench results.json files (real files in tmp)."""

from __future__ import annotations

import json

from bench.one_card import main, rows, table


def _results(path, runs):
    path.mkdir(parents=True)
    (path / "results.json").write_text(json.dumps({"device": "1x NVIDIA H100 80GB HBM3",
                                                   "results": runs}))


def test_rows_pair_ours_with_trl_and_set_the_plan_beside_the_peaks(tmp_path):
    ours = {"name": "async1", "ok": True, "samples_per_s": 50.0, "mfu": 0.14,
            "gpu_mem_peak_gb": {"0": 72.1}, "plan_peak_gb": 71.7, "plan_learner_gb": 46.1,
            "learner_peak_gb": 44.3, "card_gb": 85.5, "plan": "memory plan: ...",
            "oom_retries": 0, "note": ""}
    trl = {"name": "trl-colocate", "ok": True, "samples_per_s": 20.0, "mfu": None,
           "gpu_mem_peak_gb": {"0": 60.0}, "note": ""}
    _results(tmp_path / "1.5b", [ours, trl])
    found = rows(tmp_path)
    assert [r["run"] for r in found] == ["async1", "trl-colocate"]
    assert found[0]["vs_trl"] == 2.5 and found[1]["vs_trl"] is None
    assert found[0]["card_peak_frac"] == round(72.1 / 85.5, 3)
    assert found[1]["card_gb"] == 85.5  # the card from our run of the same call
    text = table(found)
    assert "| 1.5b | async1 | 50.0 | 14.0% | 72.1 (84.3%) | 71.7 | 44.3 | 46.1 | 0 | 2.5x |" in text
    assert main([str(tmp_path), "--json", str(tmp_path / "out.json")]) == 0
    assert len(json.loads((tmp_path / "out.json").read_text())) == 2
