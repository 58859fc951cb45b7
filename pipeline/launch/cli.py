"""``pipeline-train``: the command-line launcher.

Flags are generated from the config dataclasses (``--train.lr``, ``--sync.barrier`` ...), so every
option is documented once, in ``pipeline.config``; the common ones also have short aliases.
Importing this module must stay cheap (no torch, no vLLM): ``--help`` answers in well under 2 s.
"""

from __future__ import annotations

import argparse
import difflib
import math
import sys
import typing
from typing import Any

from pipeline.config import RunConfig, load_config
from pipeline.launch.args import OneLineParser
from pipeline.launch.derive import resolve
from pipeline.launch.placement import check_placement
from pipeline.options import ConfigError, iter_help, iter_options, parse_value, renamed_options

ALIASES = {
    "mode": "train.mode", "max-staleness": "train.max_staleness", "steps": "train.steps",
    "batch-groups": "train.batch_groups", "lr": "train.lr", "group-size": "generation.group_size",
    "max-tokens": "generation.max_tokens", "model": "model.path", "data": "data.path",
    "num-producers": "num_producers", "run-dir": "run_dir", "name": "name",
    "insecure": "insecure", "curve-keys": "curve_keys", "barrier": "sync.barrier",
    "sync-every": "sync.sync_every", "allow-untested-vllm": "engine.allow_untested_vllm",
    "launcher": "launch.backend", "ray-address": "launch.ray_address",
}


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows argparse defaults only where argparse holds one: a config option's flag defaults
    to None (unset, so the YAML file's value stands) and its help carries the real default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default is None else super()._get_help_string(action)


def _metavar(tp: Any) -> str:
    """The value an option takes, for --help: {a,b} for choices, else its type's name."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Literal:
        return "{" + ",".join(map(str, args)) + "}"
    if len(args) == 1 and type(None) in typing.get_args(tp):
        return _metavar(args[0])  # Optional[X]: `null` is accepted too (see --help text)
    base = typing.get_origin(tp) or tp
    return {bool: "BOOL", int: "INT", float: "FLOAT", str: "STR", list: "LIST",
            dict: "MAPPING"}.get(base, "VALUE")


def _option_help(text: str, default: Any, tp: Any) -> str:
    if type(None) in typing.get_args(tp):
        text += " (null to unset)" if default is not None else ""
    shown = "null" if default is None else default
    if isinstance(default, bool):
        shown = str(default).lower()
    if default in ("", [], {}):  # empty: the help text says what unset means
        return text.replace("%", "%%")
    # argparse %-formats help strings: a literal % in a docstring must be doubled.
    return f"{text} (default: {shown})".replace("%", "%%").strip()


def _count(text: str) -> int:
    """argparse type: a non-negative integer."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="pipeline-train",
        usage="%(prog)s [--config FILE] [--OPTION VALUE ...] [--set KEY=VALUE ...]\n"
              "       %(prog)s eval --checkpoint DIR [--config FILE] [--set KEY=VALUE ...]\n"
              "       %(prog)s scale RUN_DIR (--producers N | --remove ID)",
        description="Asynchronous pipelined GRPO: vLLM producers -> ZeroMQ rollout buffer -> "
                    "learner, with versioned weight sync. Options come from a YAML --config "
                    "and/or flags (flags win).",
        formatter_class=_Formatter)
    run = p.add_argument_group("run")
    run.add_argument("--config", metavar="FILE", help="YAML config file (see examples/*.yaml)")
    run.add_argument("--role", choices=["all", "learner", "producer"], default="all",
                     help="all: learner + producers here; learner/producer: one side only "
                          "(multi-host)")
    run.add_argument("--connect", metavar="HOST:PORT",
                     help="producer role: the learner's address (sets addr=tcp://HOST:PORT)")
    run.add_argument("--producer-index", type=_count, default=0, metavar="INT",
                     help="producer role: this producer's index, below num_producers (or below "
                          "max_producers: it joins an elastic run); the index after those: the "
                          "dedicated evaluator (eval.producer dedicated)")
    run.add_argument("--resume", action="store_true",
                     help="continue from run_dir's latest checkpoint (model, optimizer, step, "
                          "version, dataset cursors, buffered groups); producers resend what "
                          "their killed predecessors left in run_dir/producers (without "
                          "--resume those outbox logs are cleared)")
    run.add_argument("--max-producer-restarts", type=_count, default=0, metavar="INT",
                     help="restart a dead producer up to this many times (0: a dead producer "
                          "stops the run)")
    run.add_argument("--max-learner-restarts", type=_count, default=0, metavar="INT",
                     help="restart a dead learner from its last checkpoint up to this many times "
                          "while producers keep running (0: a dead learner stops the run)")
    run.add_argument("--verbose", action="store_true",
                     help="show every process's log on the console (vLLM's and the libraries' "
                          "INFO lines too); without it the console shows progress, warnings, "
                          "errors and the summary, and the rest is in run_dir/logs/")
    run.add_argument("--reward", action="append", metavar="MODULE:ATTR[@WEIGHT]",
                     help="reward function(s); replaces rewards.specs (repeatable)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="any option by dotted name (YAML value), e.g. --set "
                          "train.loss.kl_coef=0.05 or --set 'engine.extra={max_logprobs: 20}'")
    rev = {v: k for k, v in ALIASES.items()}
    groups: dict[str, argparse._ArgumentGroup] = {}
    # Help texts and defaults come from the config dataclasses, nested sections included
    # (--train.loss.clip_eps_low ...): each field's docstring is its help text.
    for name, tp, default, text in iter_help(RunConfig):
        section = name.rsplit(".", 1)[0] if "." in name else "top-level"
        g = groups.setdefault(section, p.add_argument_group(f"{section} options"))
        flags = [f"--{name}"] + ([f"--{rev[name]}"] if rev.get(name, name) != name else [])
        extra: dict[str, Any] = {"nargs": "?", "const": "true"} if tp is bool else {}
        g.add_argument(*flags, dest=name, default=None, metavar=_metavar(tp),
                       help=_option_help(text, default, tp), **extra)
    for old in renamed_options(RunConfig):  # a renamed option's former flag still works
        p.add_argument(f"--{old}", dest=old, default=None, help=argparse.SUPPRESS)
    return p


def reward_spec(text: str) -> dict[str, Any]:
    """One ``--reward MODULE:ATTR[@WEIGHT]`` as a rewards.specs entry; ConfigError otherwise."""
    module, colon, rest = text.rpartition(":")
    attr, at, weight_text = rest.partition("@")
    want = "MODULE:ATTR or path/to/file.py:ATTR, optionally followed by @WEIGHT (a number)"
    if not colon or not module.strip() or not attr.strip():
        raise ConfigError(f"--reward {text!r}: expected {want}")
    weight = 1.0
    if at:
        try:
            weight = float(weight_text)
        except ValueError:
            weight = math.nan
        if not math.isfinite(weight):
            raise ConfigError(f"--reward {text!r}: the weight after @ must be a finite number, "
                              f"got {weight_text!r}")
    return {"fn": f"{module}:{attr}", "weight": weight}


def parse(argv: list[str] | None = None) -> tuple[RunConfig, argparse.Namespace]:
    """The run's config from the command line, its derived values decided
    (``pipeline.launch.derive``), and the launcher's own arguments."""
    parser = build_parser()
    args = parser.parse_args(argv)
    types = {name: tp for name, _f, tp in iter_options(RunConfig)}
    # A former name stays in the overrides: building the config says it is deprecated.
    renamed = renamed_options(RunConfig)
    overrides: dict[str, Any] = {}
    for item in args.set:
        if "=" not in item:
            parser.error(f"--set expects KEY=VALUE, got {item!r}")
        key, text = item.split("=", 1)
        if key not in types and key not in renamed:
            close = difflib.get_close_matches(key, types, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            parser.error(f"--set: unknown option {key!r}{hint}")
        overrides[key] = parse_value(text, types[renamed.get(key, key)], key)
    for name, tp in [*types.items(), *((old, types[new]) for old, new in renamed.items())]:
        text = getattr(args, name, None)
        if text is not None:
            overrides[name] = parse_value(text, tp, name)
    if args.reward:
        overrides["rewards.specs"] = [reward_spec(r) for r in args.reward]
    if args.connect:
        host, _, port = args.connect.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--connect {args.connect!r}: expected HOST:PORT with a port in "
                              "1-65535")
        overrides["addr"] = f"tcp://{args.connect}"
    return resolve(load_config(args.config, overrides), args.role), args


def check_producer_index(cfg: RunConfig, role: str, index: int) -> None:
    """--producer-index names one of the run's producers, or its dedicated evaluator."""
    from pipeline.schedule import evaluator_index

    ev = cfg.eval
    if role != "producer" or index < cfg.producer_slots or \
            index == evaluator_index(cfg.producer_slots, ev.every, ev.producer):
        return
    raise ConfigError(f"--producer-index: the run has producers 0 .. {cfg.producer_slots - 1} "
                      f"(num_producers {cfg.num_producers}, max_producers {cfg.max_producers}), "
                      f"got {index}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["scale"]:  # `pipeline-train scale RUN_DIR --producers N`: elastic runs
        from pipeline.launch.scale import main as scale_main

        return scale_main(argv[1:])
    if argv[:1] == ["eval"]:  # `pipeline-train eval --checkpoint DIR`: one checkpoint alone
        from pipeline.launch.evaluation import main as eval_main

        return eval_main(argv[1:])
    try:
        cfg, args = parse(argv)
        # A pinned placement that rules out an explicit route fails here, in one line,
        # not as a silent file fallback once the engines are up.
        check_placement(cfg.sync.route, cfg.learner_gpus, cfg.producer_gpus)
        check_producer_index(cfg, args.role, args.producer_index)
    except ConfigError as e:
        print(f"pipeline-train: config error: {e}", file=sys.stderr)
        return 2
    from pipeline.launch.console import launcher_logging
    from pipeline.launch.local import run

    launcher_logging(args.verbose)
    try:
        if cfg.launch.backend == "ray":
            if args.role != "all":
                raise ConfigError("--role: the Ray launcher places every role itself; use "
                                  "--role all (the default)")
            from pipeline.launch.ray import run as run_ray

            return run_ray(cfg, resume=args.resume,
                           max_producer_restarts=args.max_producer_restarts,
                           max_learner_restarts=args.max_learner_restarts, verbose=args.verbose)
        return run(cfg, role=args.role, resume=args.resume, producer_index=args.producer_index,
                   max_producer_restarts=args.max_producer_restarts,
                   max_learner_restarts=args.max_learner_restarts, verbose=args.verbose)
    except ConfigError as e:
        print(f"pipeline-train: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
