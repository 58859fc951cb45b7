"""pipeline.producer.data: prompt sources, sharding across producers and cursor resume."""

from __future__ import annotations

import itertools
import json

import pytest

from pipeline.config import DataConfig
from pipeline.options import ConfigError
from pipeline.producer.data import PromptSource, load_records


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _records(n):
    return [{"prompt_id": f"q{i}", "prompt": f"question {i}", "answer": str(i)} for i in range(n)]


def test_jsonl_records_and_meta(tmp_path):
    p = _write_jsonl(tmp_path / "d.jsonl", _records(3))
    (tmp_path / "d.jsonl").write_text(p.read_text() + "\n   \n")  # blank lines are skipped
    assert load_records(str(p)) == _records(3)
    src = PromptSource(DataConfig(path=str(p), seed=-1), 0, 1)
    rec = next(src)
    assert (rec.prompt_id, rec.prompt, rec.meta, rec.cursor) == (
        "q0",
        "question 0",
        {"prompt_id": "q0", "answer": "0"},
        1,
    )


def test_id_falls_back_to_index(tmp_path):
    p = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    src = PromptSource(DataConfig(path=str(p), seed=-1), 0, 1)
    assert [next(src).prompt_id for _ in range(2)] == ["0", "1"]


def test_bad_json_line_names_path_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
    with pytest.raises(ConfigError, match=rf"{p}:2"):
        load_records(str(p))
    p.write_text('{"prompt": "ok"}\n[1, 2]\n')
    with pytest.raises(ConfigError, match=rf"{p}:2: each line must be a JSON object"):
        load_records(str(p))


def test_missing_path_and_prompt_field(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_records(str(tmp_path / "nope.jsonl"))
    p = _write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    with pytest.raises(ConfigError, match=r"data.prompt_field"):
        PromptSource(DataConfig(path=str(p)), 0, 1)
    with pytest.raises(ConfigError, match="fewer than"):
        PromptSource(DataConfig(path=str(p), prompt_field="text"), 3, 4)


def test_arithmetic_source():
    recs = load_records("arithmetic:5")
    assert len(recs) == 5
    assert all({"prompt", "answer", "prompt_id"} <= set(r) for r in recs)
    assert recs == load_records("arithmetic:5")  # deterministic
    with pytest.raises(ConfigError, match="arithmetic:N"):
        load_records("arithmetic:many")


def test_datasets_dir(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(_records(4)).save_to_disk(str(tmp_path / "ds"))
    assert load_records(str(tmp_path / "ds")) == _records(4)


@pytest.mark.parametrize("num_producers", [1, 2, 3])
def test_sharding_is_a_partition(num_producers):
    cfg = DataConfig(path="arithmetic:20", seed=3)
    recs = load_records(cfg.path)
    shards = []
    for k in range(num_producers):
        src = PromptSource(cfg, k, num_producers, records=recs)
        per_epoch = len(range(k, len(recs), num_producers))
        shards.append([r.prompt_id for r in itertools.islice(src, per_epoch)])
    flat = [pid for s in shards for pid in s]
    assert sorted(flat) == sorted(r["prompt_id"] for r in recs)  # every record exactly once
    assert len(set(flat)) == len(flat)


def test_cursor_resume_gives_the_same_sequence():
    cfg = DataConfig(path="arithmetic:7", seed=5)
    recs = load_records(cfg.path)
    full = [
        (r.prompt_id, r.cursor) for r in itertools.islice(PromptSource(cfg, 1, 2, records=recs), 12)
    ]
    # Crosses an epoch boundary (shard of 3): epochs are reshuffled yet reproducible.
    resumed = PromptSource(cfg, 1, 2, start_cursor=5, records=recs)
    assert [(r.prompt_id, r.cursor) for r in itertools.islice(resumed, 7)] == full[5:]
    # Setting the cursor on a live source (as the producer does after a learner restart).
    src = PromptSource(cfg, 1, 2, records=recs)
    next(src)
    src.cursor = 9
    assert next(src).prompt_id == full[9][0]


def test_epochs_cover_the_shard_and_seed_minus_one_keeps_order():
    recs = _records(6)
    src = PromptSource(DataConfig(path="x", seed=1), 0, 1, records=recs)
    ids = [r.prompt_id for r in itertools.islice(src, 12)]
    assert sorted(ids[:6]) == sorted(ids[6:]) == sorted(r["prompt_id"] for r in recs)
    ordered = PromptSource(DataConfig(path="x", seed=-1), 0, 1, records=recs)
    assert [r.prompt_id for r in itertools.islice(ordered, 6)] == [f"q{i}" for i in range(6)]


def test_leases_are_read_in_order_and_the_cursor_counts_over_them():
    """The learner's leases (``pipeline.learner.roster``): positions of the run's sequence, read
    in lease order; the cursor counts positions over the leases, a read prefix dropped into
    ``base`` changes nothing, and a source out of leases gives None until it gets more."""
    recs = _records(6)
    src = PromptSource(DataConfig(path="x", seed=-1), records=recs)
    src.lease(0, [(4, 6), (1, 2)])
    got = [(r.prompt_id, r.position, r.cursor) for r in iter(src.take, None)]
    assert got == [("q4", 4, 1), ("q5", 5, 2), ("q1", 1, 3)]
    src.lease(2, [(1, 2), (7, 8)])  # the first range dropped as read; position 7 is epoch 1
    rec = src.take()
    assert (rec.prompt_id, rec.position, rec.cursor) == ("q1", 7, 4) and src.take() is None
    fresh = PromptSource(DataConfig(path="x", seed=-1), records=recs)
    fresh.lease(2, [(1, 2)])  # a restarted producer below base resumes at it
    assert fresh.cursor == 2 and fresh.take().position == 1
