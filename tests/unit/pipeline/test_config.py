"""pipeline.config: YAML + dotted overrides, validation naming the option."""

from __future__ import annotations

import pytest

from pipeline.config import RunConfig, load_config
from pipeline.options import ConfigError, parse_value


def test_defaults_load():
    cfg = load_config()
    assert isinstance(cfg, RunConfig)
    assert cfg.train.mode == "async" and cfg.run_dir.endswith("run")


def test_yaml_and_dotted_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("name: exp\ntrain:\n  lr: 0.001\n  batch_groups: 4\n"
                 "generation:\n  group_size: 4\nengine:\n  extra: {swap_space: 1}\n")
    cfg = load_config(p, {"train.lr": 2e-5, "generation.max_tokens": 16,
                          "train.loss.kl_coef": 0.1, "engine.max_num_seqs": 8})
    assert cfg.name == "exp"
    assert cfg.train.lr == 2e-5            # the override wins over the file
    assert cfg.train.batch_groups == 4     # the file wins over the default
    assert cfg.generation.group_size == 4 and cfg.generation.max_tokens == 16
    assert cfg.train.loss.kl_coef == 0.1
    assert cfg.engine.max_num_seqs == 8 and cfg.engine.extra == {"swap_space": 1}
    assert cfg.engine.enable_prefix_caching is None  # unset stays unset


def test_float_options_take_exponent_notation_from_yaml_and_cli(tmp_path):
    # YAML 1.1 reads 5e-5 (no dot) as a string; users write learning rates that way.
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  lr: 5e-5\n  loss:\n    kl_coef: 1\n")
    cfg = load_config(p)
    assert cfg.train.lr == 5e-5 and isinstance(cfg.train.lr, float)
    assert cfg.train.loss.kl_coef == 1.0 and isinstance(cfg.train.loss.kl_coef, float)
    text = parse_value("3e-6", float, "train.lr")  # what the CLI hands to load_config
    assert load_config(None, {"train.lr": text}).train.lr == 3e-6
    with pytest.raises(ConfigError, match=r"train\.lr: expected a number, got 'fast'"):
        load_config(None, {"train.lr": "fast"})


def test_unknown_key_names_the_option(tmp_path):
    with pytest.raises(ConfigError, match=r"train: unknown option\(s\) learning_rate"):
        load_config(None, {"train.learning_rate": 1e-5})
    with pytest.raises(ConfigError, match=r"unknown option.*bogus"):
        load_config(None, {"bogus": 1})
    p = tmp_path / "c.yaml"
    p.write_text("engine:\n  prefix_cache: true\n")
    with pytest.raises(ConfigError, match=r"engine: unknown option.*prefix_cache"):
        load_config(p)


def test_missing_file_and_bad_top_level(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.yaml")
    p = tmp_path / "c.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"train.lr.x: lr is not a section"):
        load_config(None, {"train.lr": 1.0, "train.lr.x": 2})


@pytest.mark.parametrize("key,value,match", [
    ("train.lr", 0.0, "train.lr"),
    ("train.max_staleness", -1, "train.max_staleness"),
    ("train.mode", "semi", "train.mode"),
    ("generation.group_size", 1, "generation.group_size"),
    ("generation.temperature", 0.0, "generation.temperature"),
    ("engine.gpu_memory_utilization", 1.5, "engine.gpu_memory_utilization"),
    ("model.dtype", "int8", "model.dtype"),
    ("sync.barrier", "yolo", "sync.barrier"),
    ("sync.keep_snapshots", 1, "sync.keep_snapshots"),
    ("rewards.on_failure", "ignore", "rewards.on_failure"),
    ("rewards.specs", [{"weight": 1.0}], r"rewards.specs\[0\]"),
    ("num_producers", 0, "num_producers"),
    ("buffer_order", "random", "buffer_order"),
])
def test_invalid_values_name_the_option(key, value, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, {key: value})


def test_sync_mode_checks_divisibility():
    # Its staleness (0) is decided by the launcher: tests/unit/pipeline/launch/test_derive.py.
    cfg = load_config(None, {"train.mode": "sync", "train.max_staleness": 3,
                             "train.batch_groups": 4, "num_producers": 2})
    assert cfg.train.max_staleness == 3  # as written: the config only declares and checks
    with pytest.raises(ConfigError, match="divisible by num_producers"):
        load_config(None, {"train.mode": "sync", "train.batch_groups": 5, "num_producers": 2})
    # Async mode has no such constraint.
    cfg = load_config(None, {"train.batch_groups": 5, "num_producers": 2})
    assert cfg.train.max_staleness == 1


def test_buffer_capacity_check():
    # Its default (0: derived from the admission budget) is the launcher's: test_derive.py.
    assert load_config(None, {"train.batch_groups": 4}).buffer_capacity == 0
    assert load_config(None, {"train.batch_groups": 4, "buffer_capacity": 4}).buffer_capacity == 4
    with pytest.raises(ConfigError, match="buffer_capacity"):
        load_config(None, {"train.batch_groups": 4, "buffer_capacity": 3})


def test_gpu_placement_pins_each_producer_and_the_learner():
    from pipeline.launch.placement import learner_gpu_env, producer_gpu_env

    cfg = load_config(overrides={"num_producers": 3, "producer_gpus": [1, "2,3"],
                                 "learner_gpus": 0})
    assert [producer_gpu_env(cfg.producer_gpus, i) for i in range(3)] == [
        {"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": "2,3"},
        {"CUDA_VISIBLE_DEVICES": "1"}]
    assert learner_gpu_env(cfg.learner_gpus) == {"CUDA_VISIBLE_DEVICES": "0"}
    default = load_config()
    assert producer_gpu_env(default.producer_gpus, 0) == {}
    assert learner_gpu_env(default.learner_gpus) == {}


@pytest.mark.parametrize("role,index,want", [("learner", None, "3"), ("producer", 1, "2")])
def test_children_pin_their_gpus_before_building_the_config_fake_load(monkeypatch, tmp_path,
                                                                       role, index, want):
    """Building the config may touch CUDA (an explicit ipc/nccl transport counts GPUs); once
    CUDA is up, CUDA_VISIBLE_DEVICES no longer moves the process. The pin the launcher passes
    (its placement) must come first. (load_config is replaced by a recorder: pure ordering
    logic.)"""
    import os

    import pipeline.learner.main as learner_main
    import pipeline.producer.main as producer_main
    from pipeline.launch.placement import learner_gpu_env, producer_gpu_env
    from pipeline.options import to_dict

    cfg = to_dict(load_config(overrides={"num_producers": 2, "producer_gpus": ["1", "2"],
                                         "learner_gpus": "3", "run_dir": str(tmp_path)}))
    seen = {}

    def recorder(**_kw):
        seen["cuda_visible"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise SystemExit(0)

    module = learner_main if role == "learner" else producer_main
    monkeypatch.setattr(module, "load_config", recorder)
    monkeypatch.setattr(module, "child_setup", lambda *_a, **_k: None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with pytest.raises(SystemExit):
        if role == "learner":
            learner_main.learner_entry(cfg, "/model", False, learner_gpu_env(cfg["learner_gpus"]))
        else:
            producer_main.producer_entry(cfg, "/model", index,
                                         producer_gpu_env(cfg["producer_gpus"], index))
    assert seen["cuda_visible"] == want


@pytest.mark.parametrize("key,value", [("producer_gpus", ["0;1"]), ("producer_gpus", [""]),
                                       ("learner_gpus", "gpu0"), ("producer_gpus", "0")])
def test_bad_gpu_placement_names_the_option(key, value):
    with pytest.raises(ConfigError, match=key):
        load_config(overrides={key: value})


def test_sync_route_defaults_to_auto_and_accepts_file():
    assert load_config().sync.route == "auto"
    assert load_config(None, {"sync.route": "file"}).sync.route == "file"
    with pytest.raises(ConfigError, match=r"sync\.route: must be auto, file, ipc or nccl"):
        load_config(None, {"sync.route": "rdma"})


def test_sync_transport_is_an_alias_of_sync_route_with_one_deprecation_line(tmp_path, caplog):
    """The option's former name still works, from a YAML file and from --set, and says once
    that it is now sync.route; an override wins over the file under either name."""
    from pipeline.launch.cli import parse

    def deprecations() -> list[str]:
        lines = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
        caplog.clear()
        return lines

    line = ["option sync.transport is deprecated: it is now sync.route"]
    p = tmp_path / "c.yaml"
    p.write_text("sync:\n  transport: file\n")
    with caplog.at_level("WARNING", logger="pipeline.options"):
        assert load_config(p).sync.route == "file"
        assert deprecations() == line
        cfg, _ = parse(["--config", str(p), "--set", "sync.transport=ipc"])
        assert cfg.sync.route == "ipc" and deprecations() == line  # the file's is overridden
        cfg, _ = parse(["--set", "sync.transport=file"])
        assert cfg.sync.route == "file" and deprecations() == line
        cfg, _ = parse(["--sync.transport", "file"])  # the former flag
        assert cfg.sync.route == "file" and deprecations() == line
        cfg, _ = parse(["--config", str(p), "--sync.route", "auto"])  # the flag wins
        assert cfg.sync.route == "auto"
        with pytest.raises(ConfigError, match=r"sync\.route: must be auto, file, ipc or nccl"):
            load_config(None, {"sync.transport": "rdma"})
        p.write_text("sync:\n  transport: file\n  route: ipc\n")
        with pytest.raises(ConfigError, match=r"sync\.transport: renamed sync\.route, which is "
                                              r"set too"):
            load_config(p)


def test_gpu_transport_without_gpus_is_a_config_error(monkeypatch):
    import pipeline.launch.placement as placement

    # The config declares it; the launcher's placement check refuses it on this machine.
    for t in ("nccl", "ipc"):
        assert load_config(None, {"sync.route": t}).sync.route == t
    monkeypatch.setattr(placement, "cuda_device_count", lambda: 0)  # mock: a CPU machine
    for t in ("nccl", "ipc"):
        with pytest.raises(ConfigError, match=f"sync.route: '{t}' needs NVIDIA GPUs"):
            placement.check_placement(t, "", [])
    monkeypatch.setattr(placement, "cuda_device_count", lambda: 1)  # mock: one GPU
    for t in ("nccl", "ipc"):
        placement.check_placement(t, "", [])
    with pytest.raises(ConfigError, match=r"sync\.nccl_timeout_s"):
        load_config(None, {"sync.nccl_timeout_s": 0})


def test_gpu_transport_on_this_cpu_machine_is_refused():
    import torch

    from pipeline.launch.placement import check_placement

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(ConfigError, match="CPU build"):
        check_placement("nccl", "", [])


def test_check_placement_refuses_impossible_gpu_placements(monkeypatch):
    import pipeline.launch.placement as placement
    from pipeline.launch.placement import check_placement

    monkeypatch.setattr(placement, "cuda_device_count", lambda: 4)  # mock: this machine has none
    check_placement("nccl", "0", ["1", "2,3"])
    with pytest.raises(ConfigError, match=r"producer_gpus\[1\]: .*NCCL cannot put two ranks"):
        check_placement("nccl", "0", ["1", "0"])
    check_placement("ipc", "0", ["0"])
    with pytest.raises(ConfigError, match="needs the producer on the learner's GPU"):
        check_placement("ipc", "0", ["1"])
    check_placement("ipc", "", ["1"])  # unknown placement: checked at run time instead
    check_placement("auto", "0", ["0"])  # auto always fits


def test_sleep_when_idle_needs_sync_mode():
    with pytest.raises(ConfigError, match=r"engine\.sleep_when_idle: needs train\.mode sync"):
        load_config(overrides={"engine.sleep_when_idle": True})
    cfg = load_config(overrides={"engine.sleep_when_idle": True, "train.mode": "sync"})
    assert cfg.engine.sleep_when_idle


def test_numpy_scalars_and_str_subclasses_stand_for_their_builtin():
    """The Python API takes what a notebook holds: np.str_ is a str, np.float64/np.int64 are
    numbers; each is stored as the builtin so the config stays YAML- and msgpack-safe."""
    import numpy as np
    import yaml

    from pipeline.config import LossConfig, TrainConfig
    from pipeline.options import to_dict

    class Name(str):
        pass

    loss = LossConfig(off_policy=np.str_("ppo"), kl_coef=np.float32(0.5), is_cap=np.int64(4))
    assert loss.off_policy == "ppo" and type(loss.off_policy) is str
    assert type(loss.kl_coef) is float and loss.kl_coef == 0.5
    assert type(loss.is_cap) is float and loss.is_cap == 4.0
    train = TrainConfig(lr=np.float64(2e-5), batch_groups=np.int64(4), steps=np.uint16(3),
                        mode=Name("sync"), loss=loss)
    assert (train.lr, train.batch_groups, train.steps, train.mode) == (2e-5, 4, 3, "sync")
    assert [type(v) for v in (train.lr, train.batch_groups, train.steps, train.mode)] == [
        float, int, int, str]
    cfg = load_config(overrides={"name": np.str_("exp"), "tensorboard": np.bool_(False),
                                 "generation.stop": [np.str_("\n")],
                                 "producer_gpus": [np.int64(1)]})
    assert cfg.name == "exp" and cfg.tensorboard is False and cfg.producer_gpus == ["1"]
    assert type(cfg.generation.stop[0]) is str
    yaml.safe_dump(to_dict(cfg))  # plain builtins only


def test_numpy_scalars_keep_their_checks():
    import numpy as np

    from pipeline.config import LossConfig, TrainConfig

    with pytest.raises(ConfigError, match=r"train\.batch_groups: expected an integer"):
        TrainConfig(batch_groups=np.bool_(True))  # a bool is not an int here either
    with pytest.raises(ConfigError, match=r"train\.batch_groups: expected an integer"):
        TrainConfig(batch_groups=np.float64(2.5))
    with pytest.raises(ConfigError, match=r"train\.lr: expected a finite number"):
        TrainConfig(lr=np.float64("nan"))
    with pytest.raises(ConfigError, match=r"train\.loss\.off_policy: must be decoupled or ppo"):
        LossConfig(off_policy=np.str_("vtrace"))
    with pytest.raises(ConfigError, match=r"train\.loss\.clip_eps_low: must be in \(0, 1\)"):
        LossConfig(clip_eps_low=np.float64(2.0))


def test_max_producers_is_0_or_at_least_num_producers():
    cfg = load_config(overrides={"num_producers": 2, "max_producers": 4})
    assert cfg.producer_slots == 4
    assert load_config(overrides={"num_producers": 2}).producer_slots == 2
    with pytest.raises(ConfigError, match=r"max_producers: must be 0 .* at least num_producers"):
        load_config(overrides={"num_producers": 2, "max_producers": 1})


def test_fsdp2_needs_ranks_and_no_deepspeed_or_lora():
    """train.fsdp2 shards over the learner processes under the plain launcher: one rank, an
    accelerate config (DeepSpeed would shard too) or LoRA are refused with the option named."""
    ok = load_config(overrides={"train.fsdp2": True, "train.learner_processes": 2})
    assert ok.train.fsdp2 and ok.train.learner_processes == 2
    with pytest.raises(ConfigError, match=r"train\.fsdp2: .*learner_processes >= 2"):
        load_config(overrides={"train.fsdp2": True})
    with pytest.raises(ConfigError, match=r"train\.fsdp2: .*unset train\.accelerate_config"):
        load_config(overrides={"train.fsdp2": True, "train.learner_processes": 2,
                               "train.accelerate_config": "examples/accelerate/zero3.yaml"})
    with pytest.raises(ConfigError, match=r"train\.fsdp2: not with LoRA"):
        load_config(overrides={"train.fsdp2": True, "train.learner_processes": 2,
                               "train.lora_rank": 8})
