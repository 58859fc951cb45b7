"""bench.memory_plan: the paper layouts come from the launcher's own memory plan (pure logic)."""

from bench.memory_plan import QWEN_72B, layouts, row, table
from pipeline.memory import model_parameters


def test_72b_shape_has_qwen25_72b_parameter_count():
    assert abs(model_parameters(QWEN_72B) / 1e9 - 72.7) < 0.1


def test_rows_follow_the_plan_and_the_weights():
    rows = [row(lay) for lay in layouts()]
    seven = rows[0]
    # ZeRO-3 over 2 ranks: (2 + 16) / 2 bytes per parameter; one engine at 0.3 of 141 GB beside it
    assert seven["learner_bytes_per_param"] == 9.0
    assert abs(seven["worst_gpu_need_gb"] - (seven["learner_gb_per_gpu"] + 0.3 * 141)) < 0.2
    assert rows[1]["learner_bytes_per_param"] == 8.0  # FSDP2: 16 / 2, fp32 shards alone
    big = rows[2:]
    for r in big:
        assert r["sync_gb_per_version"] == big[0]["sync_gb_per_version"]  # bf16, 2 B/param
        assert abs(r["sync_gb_per_version"] - 2 * 72.71) < 0.2
    assert big[0]["host_gb_per_learner_node"] > 0 and big[1]["host_gb_per_learner_node"] == 0
    assert table(rows).count("\n") == len(rows) + 1
