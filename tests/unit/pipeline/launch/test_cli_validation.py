"""`pipeline-train` refuses every bad value before anything starts: exit 2, one line naming the
option (or the file and line) and what it accepts, never a traceback.

The CLI's ``main`` runs in-process with the launcher's ``run`` replaced by a recorder
(``fake_run``): a config that passes validation is recorded instead of starting engines, so the
property test can feed thousands of values quickly. Everything before ``run`` is the real code.
"""

from __future__ import annotations

import dataclasses
import math
import string
import sys
import typing

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pipeline.config import RunConfig, flatten, load_config
from pipeline.launch import cli
from pipeline.launch.args import attach_negative_values
from pipeline.options import coerce, iter_options, to_dict

OPTIONS = [(name, tp) for name, _f, tp in iter_options(RunConfig)]


@pytest.fixture
def fake_run(monkeypatch):
    """Replaces the launcher's run (which would start processes) with a recorder."""
    import pipeline.launch.local as local

    accepted: list[RunConfig] = []

    def recorder(cfg, **_kw):
        accepted.append(cfg)
        return 0

    monkeypatch.setattr(local, "run", recorder)
    return accepted


def _main(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own errors (unknown flag, missing value)
        code = e.code
    return code, capsys.readouterr().err


def _error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("pipeline-train:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    return lines[0]


# The mistaken invocations that printed tracebacks or were accepted (each one a finding).
@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--set", "train.loss.clip_eps_low=2"], "train.loss.clip_eps_low: must be in (0, 1)"),
        (["--set", "train.loss.is_cap=0.5"], "train.loss.is_cap: must be >= 1"),
        (["--train.loss.off_policy", "vtrace"], "train.loss.off_policy: must be decoupled or ppo"),
        (["--reward", "pipeline.tasks.rewards.exact_match"], "--reward"),
        (["--reward", "pipeline.tasks.rewards:exact_match@heavy"], "weight after @"),
        (["--reward", "pipeline.tasks.rewards:exact_match@nan"], "weight after @"),
        (["--batch-groups", "2.5"], "train.batch_groups: expected an integer, got 2.5"),
        (["--steps", "ten"], "train.steps: expected an integer, got 'ten'"),
        (["--engine.extra", "[1, 2]"], "engine.extra: expected a mapping"),
        (["--set", "engine.extra=5"], "engine.extra: expected a mapping"),
        (["--tensorboard", "maybe"], "tensorboard: expected true or false, got 'maybe'"),
        (["--progress", "2"], "progress: expected true or false"),
        (["--lr", "fast"], "train.lr: expected a number, got 'fast'"),
        (["--lr", "inf"], "train.lr: expected a finite number"),
        (["--set", "train.weight_decay=-1"], "train.weight_decay: must be >= 0"),
        (["--set", "sync.ack_timeout_s=0"], "sync.ack_timeout_s: must be > 0"),
        (["--set", "engine.seed=-3"], "engine.seed: must be >= 0"),
        (["--set", "train.steps=99999999999999999999999"], "train.steps"),
        (["--generation.stop", "{a: 1}"], "generation.stop: expected a list"),
        (["--set", "rewards.specs=[7]"], "rewards.specs[0]: expected a mapping"),
        (["--set", "rewards.specs=[{fn: 'a:b', weight: heavy}]"], "rewards.specs[0].weight"),
        (["--set", "rewards.specs=[{fn: 'a:b', wieght: 1}]"], "rewards.specs[0]: unknown option"),
        (["--set", "rewards.specs=[{weight: 1}]"], "rewards.specs[0]: missing fn"),
        (["--set", "producer_gpus=0"], "producer_gpus: expected a list"),
        (["--max-tokens", "4096"], "generation.max_tokens: must be below engine.max_model_len"),
        (["--connect", "nohost"], "--connect"),
        (["--set", "train.loss=1"], "--set: unknown option 'train.loss'"),
        (["--set", "generation.top_k=-1"], "generation.top_k: must be >= 0"),
    ],
)
def test_each_mistake_exits_2_with_one_line_naming_the_option(fake_run, capsys, argv, names):
    code, err = _main(argv, capsys)
    assert code == 2, err
    assert names in _error_line(err)
    assert fake_run == []  # nothing started


# argparse's own errors printed its two usage lines first; a negative number in scientific
# notation after a flag was read as a flag ("expected one argument").
@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--set", "train.nope=1"], "--set: unknown option 'train.nope'"),
        (["--bogus-opt", "1"], "unrecognized arguments: --bogus-opt 1"),
        (["--set", "train.lr"], "--set expects KEY=VALUE, got 'train.lr'"),
        (["--lr", "-1e-5"], "train.lr: must be > 0"),
        (["--lr", "-inf"], "train.lr: expected a finite number"),
        (["--train.loss.kl_coef", "-.5"], "train.loss.kl_coef: must be >= 0"),
        (["--resume", "-1e-5"], "--resume"),
        (["--steps"], "--steps"),
    ],
)
def test_argparse_mistakes_are_one_line_on_stderr_too(fake_run, capsys, argv, names):
    code, err = _main(argv, capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("pipeline-train: "), err
    assert names in err
    assert fake_run == []


def test_a_negative_value_after_a_flag_reaches_validation():
    assert attach_negative_values(["--lr", "-1e-5", "--steps", "3"]) == [
        "--lr=-1e-5", "--steps", "3"]
    # Values already attached, short flags and words are left as they are.
    assert attach_negative_values(["--lr=1", "-1", "-h", "--name", "-x"]) == [
        "--lr=1", "-1", "-h", "--name", "-x"]
    cfg, _args = cli.parse(["--set", "train.loss.kl_coef=0.1", "--train.loss.clip_eps_low",
                            "2e-1"])
    assert cfg.train.loss.clip_eps_low == 0.2


def test_a_mistyped_set_key_is_answered_with_the_closest_option(fake_run, capsys):
    code, err = _main(["--set", "train.lrr=1"], capsys)
    assert code == 2 and "did you mean 'train.lr'?" in err, err


def test_the_eval_subcommand_errors_are_one_line_too(capsys):
    code, err = _main(["eval", "--bogus"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("pipeline-train eval: error: ")


def test_cli_only_counts_are_checked_by_argparse(fake_run, capsys):
    code, err = _main(["--max-producer-restarts", "-1"], capsys)
    assert code == 2 and "--max-producer-restarts" in _error_line(err)
    assert fake_run == []


@pytest.mark.parametrize(
    ("text", "line", "what"),
    [
        ("train:\n  lr: [1, 2\n", 3, "invalid YAML"),
        ("train:\n\tlr: 1\n", 2, "invalid YAML"),
        ("name: a\nname: b: c\n", 2, "invalid YAML"),
        ("- 1\n- 2\n", None, "top level must be a mapping"),
        ("train: 5\n", None, "train: expected a mapping"),
    ],
)
def test_a_malformed_yaml_file_is_named_with_its_line(fake_run, capsys, tmp_path, text, line, what):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    code, err = _main(["--config", str(path)], capsys)
    assert code == 2, err
    msg = _error_line(err)
    assert what in msg, msg
    if line is not None:
        assert f"{path}, line {line}" in msg, msg
    assert fake_run == []


def test_unreadable_and_missing_config_files(fake_run, capsys, tmp_path):
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    for path, what in [
        (binary, "cannot read"),
        (tmp_path, "is not a file"),
        (tmp_path / "none.yaml", "does not exist"),
    ]:
        code, err = _main(["--config", str(path)], capsys)
        assert code == 2 and what in _error_line(err), err
    assert fake_run == []


def test_valid_values_of_every_type_are_accepted_and_converted(fake_run, capsys):
    code, err = _main(
        [
            "--tensorboard",
            "false",
            "--lr",
            "5e-5",
            "--set",
            "train.lr=5e-5",
            "--generation.stop",
            '["\\n", 7]',
            "--producer_gpus",
            "[1, '2,3']",
            "--engine.extra",
            "{swap_space: 1}",
            "--engine.max_num_seqs",
            "null",
            "--insecure",
            "--reward",
            "pipeline.tasks.rewards:exact_match@0.5",
        ],
        capsys,
    )
    assert code == 0, err
    (cfg,) = fake_run
    assert cfg.tensorboard is False and cfg.insecure is True
    assert cfg.train.lr == 5e-5 and isinstance(cfg.train.lr, float)
    assert cfg.generation.stop == ["\n", "7"] and cfg.producer_gpus == ["1", "2,3"]
    assert cfg.engine.extra == {"swap_space": 1} and cfg.engine.max_num_seqs is None
    assert cfg.rewards.specs[0].weight == 0.5


def test_types_are_enforced_from_python_too():
    from pipeline.config import LossConfig, TrainConfig
    from pipeline.options import ConfigError

    with pytest.raises(ConfigError, match=r"^train\.batch_groups: expected an integer, got 2\.5"):
        TrainConfig(batch_groups=2.5)
    with pytest.raises(ConfigError, match=r"^train\.loss\.clip_eps_low: must be in \(0, 1\)"):
        LossConfig(clip_eps_low=2.0)
    assert LossConfig(kl_coef=1).kl_coef == 1.0  # an int for a float is converted


def test_help_lists_nested_options_with_their_docstrings(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    # LossConfig documents its fields with docstrings, the other sections with opt(help=...).
    assert "train.loss options:" in out
    assert "--train.loss.clip_eps_low FLOAT Lower PPO clip: the ratio is clipped at" in out
    assert "--train.loss.agg {token_mean,seq_mean} Loss aggregation" in out
    assert "(default: 0.2)" in out and "(default: token_mean)" in out
    assert ("--train.lr FLOAT, --lr FLOAT AdamW learning rate of a full fine-tune (LoRA runs use "
            "train.lora_lr) (default: 1e-05)") in out
    for name, _tp in OPTIONS:  # every option has a flag and a help text
        assert f"--{name} " in out, name
    from pipeline.options import iter_help

    assert all(text for _n, _t, _d, text in iter_help(RunConfig)), "an option without help text"


# ------------------------------------------------------------------------- property test

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(string.printable, max_size=12)
    | st.sampled_from(
        [
            "true",
            "no",
            "null",
            "5e-5",
            "1.5",
            "[1",
            "{a:",
            "0,1",
            "",
            "pipeline.tasks.rewards:exact_match",
            "~",
            "---",
            "a: b",
        ]
    )
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(string.ascii_lowercase, max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def _render(draw_value, how: str) -> str:
    if how == "yaml":
        return yaml.safe_dump(draw_value, default_flow_style=True, width=1 << 20).strip()
    if isinstance(draw_value, str):
        return draw_value
    return str(draw_value)


def _option_value(cfg: RunConfig, name: str):
    node = cfg
    for part in name.split("."):
        node = getattr(node, part)
    return node


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    option=st.sampled_from(OPTIONS),
    value=_values,
    how=st.sampled_from(["set", "flag", "yaml", "file"]),
)
def test_random_values_for_every_option_exit_2_or_build_a_sound_config(
    fake_run, capsys, tmp_path_factory, option, value, how
):
    """Any value for any option either exits 2 with one line naming that option, or builds a
    config whose value has the option's type and which a child process rebuilds identically."""
    name, tp = option
    fake_run.clear()
    if how == "file":
        path = tmp_path_factory.mktemp("cfg") / "c.yaml"
        node: dict = {}
        parts = name.split(".")
        cur = node
        for part in parts[:-1]:
            cur = cur.setdefault(part, {})
        cur[parts[-1]] = value
        path.write_text(yaml.safe_dump(node))
        argv = ["--config", str(path)]
    elif how == "set":
        argv = ["--set", f"{name}={_render(value, 'yaml')}"]
    else:
        argv = [f"--{name}={_render(value, how)}"]
    code, err = _main(argv, capsys)
    assert "Traceback" not in err, err
    event("rejected" if code == 2 else "accepted")
    if code == 2:
        line = _error_line(err)
        named = name in line or name.split(".")[0] in line or "argument" in line
        assert named, (argv, line)
        assert fake_run == []
        return
    assert code == 0, (argv, err)
    (cfg,) = fake_run
    got = _option_value(cfg, name)
    assert coerce(got, tp, name) == got or (isinstance(got, float) and math.isnan(got))
    rebuilt = load_config(overrides=flatten(to_dict(cfg)))
    assert to_dict(rebuilt) == to_dict(cfg)


def test_every_option_type_is_one_the_checker_knows():
    """A new option with an annotation _coerce cannot check would silently accept anything."""
    known = {bool, int, float, str, list, dict, type(None)}

    def ok(tp) -> bool:
        origin = typing.get_origin(tp)
        if origin is typing.Literal:
            return True
        if origin is not None:
            return origin in (list, dict) or all(
                ok(a) for a in typing.get_args(tp) if a is not typing.Any
            )
        return tp in known or dataclasses.is_dataclass(tp)

    for name, tp in OPTIONS:
        assert ok(tp), f"{name}: {tp}"
    assert sys.modules["pipeline.config"]


def test_an_empty_string_option_stays_empty(fake_run, capsys):
    """`--learner_gpus ''` (what the CPU benchmark layout passes) means "no GPU", not null."""
    code, err = _main(["--learner_gpus", "", "--producer_gpus", "[]"], capsys)
    assert code == 0, err
    (cfg,) = fake_run
    assert cfg.learner_gpus == "" and cfg.producer_gpus == []
