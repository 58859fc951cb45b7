"""``pipeline-train``: the command-line launcher.

Flags are generated from the config dataclasses (``--train.lr``, ``--sync.barrier`` ...), so every
option is documented once, in ``pipeline.config``; the common ones also have short aliases.
Importing this module must stay cheap (no torch, no vLLM): ``--help`` answers in well under 2 s.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipeline.config import ConfigError, RunConfig, iter_options, load_config, parse_value

ALIASES = {
    "mode": "train.mode", "max-staleness": "train.max_staleness", "steps": "train.steps",
    "batch-groups": "train.batch_groups", "lr": "train.lr", "group-size": "generation.group_size",
    "max-tokens": "generation.max_tokens", "model": "model.path", "data": "data.path",
    "num-producers": "num_producers", "run-dir": "run_dir", "name": "name",
    "insecure": "insecure", "curve-keys": "curve_keys", "barrier": "sync.barrier",
    "sync-every": "sync.sync_every", "launcher": "launch.backend",
    "ray-address": "launch.ray_address",
}


def _help_text(f: Any) -> str:
    return f.metadata.get("help", "") if f.metadata else ""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pipeline-train",
        description="Asynchronous pipelined GRPO: vLLM producers -> ZeroMQ rollout buffer -> "
                    "learner, with versioned weight sync. Options come from a YAML --config "
                    "and/or flags (flags win).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    run = p.add_argument_group("run")
    run.add_argument("--config", help="YAML config file (see examples/*.yaml)")
    run.add_argument("--role", choices=["all", "learner", "producer"], default="all",
                     help="all: learner + producers here; learner/producer: one side only "
                          "(multi-host)")
    run.add_argument("--connect", metavar="HOST:PORT",
                     help="producer role: the learner's address (sets addr=tcp://HOST:PORT)")
    run.add_argument("--producer-index", type=int, default=0,
                     help="producer role: this producer's index (its data shard)")
    run.add_argument("--resume", action="store_true",
                     help="continue from run_dir's latest checkpoint (model, optimizer, step, "
                          "version, dataset cursors, buffered groups); producers resend what "
                          "their killed predecessors left in run_dir/producers (without "
                          "--resume those outbox logs are cleared)")
    run.add_argument("--max-producer-restarts", type=int, default=0,
                     help="restart a dead producer up to this many times (0: a dead producer "
                          "stops the run)")
    run.add_argument("--max-learner-restarts", type=int, default=0,
                     help="restart a dead learner from its last checkpoint up to this many times "
                          "while producers keep running (0: a dead learner stops the run)")
    run.add_argument("--reward", action="append", metavar="MODULE:ATTR[@WEIGHT]",
                     help="reward function(s); replaces rewards.specs (repeatable)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="any option by dotted name, e.g. --set engine.extra={swap_space: 1}")
    rev = {v: k for k, v in ALIASES.items()}
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, f, tp in iter_options(RunConfig):
        section = name.split(".")[0] if "." in name else "top-level"
        g = groups.setdefault(section, p.add_argument_group(f"{section} options"))
        flags = [f"--{name}"] + ([f"--{rev[name]}"] if name in rev else [])
        if tp is bool:
            g.add_argument(*flags, dest=name, default=None, nargs="?", const="true",
                           metavar="BOOL", help=_help_text(f))
        else:
            g.add_argument(*flags, dest=name, default=None, metavar=str(getattr(
                tp, "__name__", "VALUE")).upper(), help=_help_text(f))
    return p


def parse(argv: list[str] | None = None) -> tuple[RunConfig, argparse.Namespace]:
    parser = build_parser()
    args = parser.parse_args(argv)
    types = {name: tp for name, _f, tp in iter_options(RunConfig)}
    overrides: dict[str, Any] = {}
    for item in args.set:
        if "=" not in item:
            parser.error(f"--set expects KEY=VALUE, got {item!r}")
        key, text = item.split("=", 1)
        if key not in types:
            parser.error(f"--set: unknown option {key!r}")
        overrides[key] = parse_value(text, types[key], key)
    for name, tp in types.items():
        text = getattr(args, name, None)
        if text is not None:
            overrides[name] = parse_value(text, tp, name)
    if args.reward:
        specs = []
        for r in args.reward:
            fn, _, w = r.partition("@")
            specs.append({"fn": fn, "weight": float(w) if w else 1.0})
        overrides["rewards.specs"] = specs
    if args.connect:
        overrides["addr"] = f"tcp://{args.connect}"
    return load_config(args.config, overrides), args


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, args = parse(argv)
        # A pinned placement that rules out an explicit transport fails here, in one line,
        # not as a silent file fallback once the engines are up.
        cfg.sync.check_placement(cfg.learner_gpus, cfg.producer_gpus)
    except ConfigError as e:
        print(f"pipeline-train: config error: {e}", file=sys.stderr)
        return 2
    from pipeline.launch.local import run, setup_logging

    setup_logging()
    try:
        if cfg.launch.backend == "ray":
            if args.role != "all":
                raise ConfigError("--role: the Ray launcher places every role itself; use "
                                  "--role all (the default)")
            from pipeline.launch.ray import run as run_ray

            return run_ray(cfg, resume=args.resume,
                           max_producer_restarts=args.max_producer_restarts,
                           max_learner_restarts=args.max_learner_restarts)
        return run(cfg, role=args.role, resume=args.resume, producer_index=args.producer_index,
                   max_producer_restarts=args.max_producer_restarts,
                   max_learner_restarts=args.max_learner_restarts)
    except ConfigError as e:
        print(f"pipeline-train: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
