"""``pipeline.launch.derive.resolve``: each value derived from other options, decided once, with
one console line when it overrides a value that was set; a resolved config resolves to itself,
silently. The GPU count is faked where a decision reads it (this machine has none)."""

from __future__ import annotations

import pytest

import pipeline.launch.placement as placement
from buffer.staleness import admission_budget
from pipeline.config import flatten, load_config
from pipeline.launch.derive import resolve
from pipeline.options import ConfigError, to_dict

LORA = {"train.lora_rank": 8}


def _resolve(capsys, **over) -> tuple:
    """(the resolved config of ``over``, what resolving printed: its console lines)."""
    cfg = resolve(load_config(None, over))
    return cfg, capsys.readouterr().out.splitlines()


@pytest.fixture
def gpus(monkeypatch):
    """Fakes the GPUs the launcher sees: ``gpus(n)``."""
    def set_count(n: int) -> None:
        monkeypatch.setattr(placement, "cuda_device_count", lambda: n)

    return set_count


def test_sync_mode_trains_on_policy(capsys):
    cfg, said = _resolve(capsys, **{"train.mode": "sync"})
    assert cfg.train.max_staleness == 0 and said == []  # the default: nothing to say
    cfg, said = _resolve(capsys, **{"train.mode": "sync", "train.max_staleness": 3})
    assert cfg.train.max_staleness == 0
    assert said == ["pipeline-train: train.max_staleness 3 is ignored: train.mode sync trains "
                    "on-policy (max_staleness 0)"]
    cfg, said = _resolve(capsys, **{"train.max_staleness": 3})  # async: as written
    assert cfg.train.max_staleness == 3 and said == []


def test_buffer_capacity_is_four_admission_budgets_of_the_resolved_staleness(capsys):
    cfg, said = _resolve(capsys, **{"train.batch_groups": 4, "train.max_staleness": 2})
    assert cfg.buffer_capacity == 4 * admission_budget(4, 2) == 48 and said == []
    cfg, _ = _resolve(capsys, **{"train.batch_groups": 4, "train.max_staleness": 2,
                                 "train.mode": "sync"})
    assert cfg.buffer_capacity == 4 * admission_budget(4, 0) == 16
    cfg, said = _resolve(capsys, **{"train.batch_groups": 4, "buffer_capacity": 5})
    assert cfg.buffer_capacity == 5 and said == []  # set: kept


def test_lora_freezes_the_base_so_freeze_layers_is_ignored(capsys):
    cfg, said = _resolve(capsys, **{**LORA, "sync.lora_adapters": "off",
                                    "train.freeze_layers": 1})
    assert cfg.train.freeze_layers == 0
    assert said == ["pipeline-train: train.freeze_layers 1 is ignored: train.lora_rank 8 trains "
                    "LoRA adapters on a frozen base"]
    cfg, said = _resolve(capsys, **{"train.freeze_layers": 1})  # full fine-tune: as written
    assert cfg.train.freeze_layers == 1 and said == []


@pytest.mark.parametrize("count, want", [(0, "off"), (1, "on")])
def test_lora_adapters_auto_is_merged_on_cpu_and_adapters_on_gpus(capsys, gpus, count, want):
    # vLLM's CPU LoRA kernels generate several times slower than merged weights (BENCHMARKS).
    gpus(count)
    cfg, said = _resolve(capsys, **LORA)
    assert cfg.sync.lora_adapters == want and said == []  # 'auto' was nobody's choice
    assert cfg.adapter_plan.serving == ("lora" if count else "")
    cfg, _ = _resolve(capsys, **LORA, **{"sync.lora_adapters": "on"})
    assert cfg.sync.lora_adapters == "on"  # asked for: served even on CPU (the tests do)


def test_no_lora_decides_nothing_and_probes_no_gpu(capsys, monkeypatch):
    def no_probe() -> int:
        raise AssertionError("a full fine-tune needs no GPU count")

    monkeypatch.setattr(placement, "cuda_device_count", no_probe)
    cfg, said = _resolve(capsys)
    assert cfg.sync.lora_adapters == "auto" and said == []
    assert cfg.adapter_plan.serving == "" and not cfg.adapter_plan.adapter_only


@pytest.mark.parametrize("mode, serving", [("on", "lora"), ("merge", "merge"), ("off", "")])
def test_the_adapter_plan_is_what_the_resolved_option_says(capsys, mode, serving):
    cfg, _ = _resolve(capsys, **LORA, **{"sync.lora_adapters": mode})
    assert cfg.adapter_plan.serving == serving
    assert cfg.adapter_plan.adapter_only == bool(serving)


def test_an_unresolved_auto_plan_is_an_error_not_a_guess():
    with pytest.raises(RuntimeError, match=r"sync\.lora_adapters auto is decided"):
        load_config(None, LORA).adapter_plan  # noqa: B018 (the property is the test)


@pytest.mark.parametrize("over, why", [
    ({"sync.lora_adapters": "on", "train.lora_target_modules": ["q_proj", "lm_head"]},
     "sync.lora_adapters on is ignored: LoRA versions ship as merged full weights: vLLM's LoRA "
     "does not serve train.lora_target_modules lm_head"),
    ({"sync.lora_adapters": "on", "train.lora_rank": 1024},
     "sync.lora_adapters on is ignored: LoRA versions ship as merged full weights: "
     "train.lora_rank 1024 is above vLLM's largest max_lora_rank 512"),
    ({"train.lora_target_modules": ["q_proj", "lm_head"]},
     "sync.lora_adapters auto (default): LoRA versions ship as merged full weights: vLLM's LoRA "
     "does not serve train.lora_target_modules lm_head"),
])
def test_adapters_vllm_cannot_serve_ship_merged_with_one_line(capsys, gpus, over, why):
    gpus(1)
    cfg, said = _resolve(capsys, **{**LORA, **over})
    assert cfg.sync.lora_adapters == "off" and cfg.adapter_plan.serving == ""
    assert len(said) == 1 and said[0].startswith(f"pipeline-train: {why}"), said


@pytest.mark.parametrize("over", [{"train.lora_rank": 1024},
                                  {"train.lora_target_modules": ["q_proj", "lm_head"]}])
def test_merge_is_not_held_to_the_limits_of_vllms_lora_serving(capsys, gpus, over):
    """With merge the producers merge each adapter into their weights; vLLM's LoRA (its
    served modules, its largest rank) is never used."""
    gpus(1)
    cfg, said = _resolve(capsys, **{**LORA, "sync.lora_adapters": "merge", **over})
    assert cfg.sync.lora_adapters == "merge" and cfg.adapter_plan.serving == "merge"
    assert said == []


def test_merge_of_an_embedding_ships_merged_weights_saying_why(capsys, gpus):
    gpus(1)
    cfg, said = _resolve(capsys, **{**LORA, "sync.lora_adapters": "merge",
                                    "train.lora_target_modules": ["q_proj", "embed_tokens"]})
    assert cfg.sync.lora_adapters == "off"
    assert len(said) == 1 and "vLLM" not in said[0], said
    assert said[0].startswith("pipeline-train: sync.lora_adapters merge is ignored: LoRA "
                              "versions ship as merged full weights: "
                              "train.lora_target_modules embed_tokens: an embedding's"), said


@pytest.mark.parametrize("mode", ["on", "merge"])
def test_adapter_versions_go_by_file_even_on_the_learners_gpu(capsys, gpus, mode):
    """A producer on the learner's GPU would get the ipc route (auto): the learner would export
    a GPU copy of each version that the producer, loading adapters from files, never opens."""
    from sync.routes.base import choose_route

    gpus(1)
    cfg, said = _resolve(capsys, **{**LORA, "sync.lora_adapters": mode})
    assert cfg.sync.route == "file" and said == []  # 'auto' was nobody's choice
    assert choose_route(cfg.sync.route, "GPU-0", ["GPU-0"]) == "file"
    assert choose_route(cfg.sync.route, "GPU-0", ["GPU-1"]) == "file"
    cfg, said = _resolve(capsys, **{**LORA, "sync.lora_adapters": mode, "sync.route": "ipc"})
    assert cfg.sync.route == "file"
    assert said == [f"pipeline-train: sync.route ipc is ignored: adapter-only versions "
                    f"(sync.lora_adapters {mode}) are loaded from their snapshot files"]
    cfg, _ = _resolve(capsys, **{**LORA, "sync.lora_adapters": "off", "sync.route": "ipc"})
    assert cfg.sync.route == "ipc"  # merged full weights: any route


def test_a_producer_launched_alone_does_not_decide_auto_from_its_own_gpus(capsys, gpus):
    """The learner's launcher decided 'auto' from its GPUs; a producer deciding again from its
    own could disagree (adapters against merged weights). It is told to take the learner's."""
    from pipeline.launch.cli import parse

    gpus(1)
    with pytest.raises(ConfigError, match=r"^sync\.lora_adapters auto is decided by the "
                                          r"learner's launcher"):
        resolve(load_config(None, LORA), "producer")
    with pytest.raises(ConfigError, match="--role producer"):
        parse(["--role", "producer", "--train.lora_rank", "8"])
    for mode in ("on", "merge", "off"):  # given: taken as it is
        cfg = resolve(load_config(None, {**LORA, "sync.lora_adapters": mode}), "producer")
        assert cfg.sync.lora_adapters == mode
    assert resolve(load_config(None, {}), "producer").sync.lora_adapters == "auto"  # no LoRA
    assert resolve(load_config(None, LORA), "learner").sync.lora_adapters == "on"
    capsys.readouterr()


def test_adapter_versions_are_refused_where_weights_are_streamed(capsys):
    lora = {**LORA, "sync.lora_adapters": "on"}
    for streamed in ({"sync.stream_from": "tcp://10.0.0.1:5000"}, {"launch.backend": "ray"}):
        with pytest.raises(ConfigError, match=r"^sync\.lora_adapters: adapter-only versions"):
            _resolve(capsys, **lora, **streamed)
        _resolve(capsys, **{**lora, **streamed, "sync.lora_adapters": "off"})
        _resolve(capsys, **{**lora, **streamed, "sync.lora_adapters": "merge"})  # a file
    _resolve(capsys, **lora, **{"launch.backend": "ray", "launch.stream_weights": "never"})


def test_a_resolved_config_resolves_to_itself_silently_and_the_input_is_kept(capsys, gpus):
    gpus(1)
    written = load_config(None, {**LORA, "train.mode": "sync", "train.max_staleness": 3,
                                 "train.freeze_layers": 1})
    before = to_dict(written)
    cfg = resolve(written)
    assert to_dict(written) == before  # not modified
    assert len(capsys.readouterr().out.splitlines()) == 2
    # What every role reads: config.yaml rebuilt, resolved again (eval of a checkpoint).
    child = load_config(overrides=flatten(to_dict(cfg)))
    assert to_dict(child) == to_dict(cfg) == to_dict(resolve(child))
    assert capsys.readouterr().out == ""


def test_the_launcher_resolves_the_run_config(capsys):
    from pipeline.launch.cli import parse

    cfg, _ = parse(["--mode", "sync", "--max-staleness", "2", "--batch-groups", "4"])
    assert cfg.train.max_staleness == 0 and cfg.buffer_capacity == 16
    assert capsys.readouterr().out.splitlines() == [
        "pipeline-train: train.max_staleness 2 is ignored: train.mode sync trains on-policy "
        "(max_staleness 0)"]
