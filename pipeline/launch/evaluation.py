"""``pipeline-train eval --checkpoint DIR``: evaluate one checkpoint's weights on held-out prompts.

The figures are the ones a run logs during training (``pipeline.producer.evaluation``), computed
the same way: the checkpoint's weights are read on the CPU whatever its kind (full, LoRA merged,
DeepSpeed ZeRO-2/3 consolidated: ``pipeline.launch.checkpoint_weights``), checked against the
model, and go into one vLLM engine as a snapshot (the producers' load path,
``pipeline.producer.weights``); the ``eval.*`` options of the run's config (or
``--config``/``--set``) choose prompts, samples and threshold.
A checkpoint that cannot be read, or holds another model's weights, exits 2 with one line before
any engine starts. The engine's output goes to ``run_dir/logs/eval.log`` and the console shows
what a training run's shows (``console_to_log``: errors and this project's warnings; all with
``--verbose``), then the figures on stdout. A checkpoint holds the weights after its step: for
the final one, newer than the last version the producers ran.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig, flatten, load_config
from pipeline.launch.args import OneLineParser
from pipeline.launch.derive import resolve
from pipeline.options import ConfigError, iter_options, parse_value, renamed_options


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="pipeline-train eval",
        description="Evaluate a checkpoint on held-out prompts (eval.data) and print/write "
        "eval/reward_mean, eval/pass@k and each reward's mean.",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="a checkpoint dir (run_dir/checkpoints/step_N) or a run_dir (its latest)",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="config YAML (default: the run's config.yaml next to its checkpoints)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any option by dotted name, e.g. --set eval.data=heldout.jsonl",
    )
    p.add_argument(
        "--out", metavar="FILE", help="write the figures as JSON here (default: DIR/eval.json)"
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show every line of the engine's log (run_dir/logs/eval.log) here",
    )
    return p


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint dir itself, or a run_dir's latest; ConfigError naming --checkpoint."""
    from pipeline.learner.checkpoint import latest_checkpoint

    if (path / "state.json").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ConfigError(
            f"--checkpoint: {path} is neither a checkpoint (no state.json) nor a "
            f"run_dir with checkpoints"
        )
    return latest


def config_for(ckpt: Path, config: str | None, sets: list[str]) -> RunConfig:
    """The run's config (``run_dir/config.yaml``) or ``--config``, with ``--set`` overrides,
    resolved as the launcher resolves a run's (``pipeline.launch.derive``)."""
    import yaml

    types = {name: tp for name, _f, tp in iter_options(RunConfig)}
    renamed = renamed_options(RunConfig)  # a former name: building the config says so
    overrides: dict[str, Any] = {}
    for item in sets:
        key, eq, text = item.partition("=")
        if not eq or (key not in types and key not in renamed):
            raise ConfigError(f"--set: expected KEY=VALUE with a known option, got {item!r}")
        overrides[key] = parse_value(text, types[renamed.get(key, key)], key)
    if config is not None:
        return resolve(load_config(config, overrides))
    run_cfg = ckpt.parent.parent / "config.yaml"
    if not run_cfg.is_file():
        raise ConfigError(f"--config: {run_cfg} not found; name the run's config with --config")
    try:
        data = flatten(yaml.safe_load(run_cfg.read_text()))
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--config: cannot read {run_cfg}: {e}") from None
    return resolve(load_config(None, {**data, **overrides}))


def checkpoint_snapshot(cfg: RunConfig, model_path: str, ckpt: Path, directory: Path) -> Any:
    """The checkpoint's weights as a snapshot file in ``directory`` and its learner state:
    ``(SnapshotRef, LearnerState, kind)``. Whatever the checkpoint's kind (full weights, LoRA,
    DeepSpeed ZeRO-2/3: ``pipeline.launch.checkpoint_weights``), the snapshot holds every tensor
    of the model, LoRA merged; CheckpointError (one line) if the checkpoint is unreadable or
    another model's."""
    import torch

    from pipeline.launch.checkpoint_weights import checkpoint_weights
    from sync.snapshot import write_snapshot

    state, weights, kind = checkpoint_weights(
        ckpt, model_path, cfg.train.lora_alpha, getattr(torch, cfg.model.dtype)
    )
    # One past the run's last version: a version the freshly started engine has not run.
    ref = write_snapshot(weights, state.version + 1, directory)
    del weights
    gc.collect()
    return ref, state, kind


async def _evaluate(cfg: RunConfig, model_path: str, ref: Any) -> dict[str, float]:
    from transformers import AutoTokenizer

    from pipeline.producer.engine import build_engine
    from pipeline.producer.evaluation import eval_records
    from pipeline.producer.rewards.runner import RewardSet

    records = eval_records(cfg.data, cfg.eval)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rewards = RewardSet(
        cfg.rewards.specs, on_failure=cfg.rewards.on_failure, pool_workers=cfg.rewards.pool_workers
    )
    engine = build_engine(cfg.model, cfg.engine, model_path, cfg.engine.seed)
    try:
        return await _load_and_score(engine, cfg, tokenizer, records, rewards, ref)
    finally:
        rewards.close()
        engine.shutdown()
        # Collect the engine now (the weights that held it died with _load_and_score):
        # AsyncLLM.__del__ calls shutdown() again, which fails noisily when it runs at
        # interpreter teardown.
        del engine
        gc.collect()


async def _load_and_score(engine: Any, cfg: RunConfig, tokenizer: Any, records: Any,
                          rewards: Any, ref: Any) -> dict[str, float]:
    from pipeline.producer.episode import load_episode
    from pipeline.producer.evaluation import EpisodeRun, generate_and_score
    from pipeline.producer.weights import EngineWeights
    from sync.routes import make_route

    # The snapshot is a local file of every weight (LoRA merged), loaded into an idle engine:
    # read where it lies (never streamed), no drain, no adapters whatever the run's plan.
    weights = EngineWeights(
        engine, cfg, "eval", {"file": make_route("file", engine)}, barrier_mode="keep", serving=""
    )
    report = await weights.load(ref)
    if report is None or not report.ok:
        raise RuntimeError(
            f"loading the checkpoint's weights failed: {report.error if report else 'no file'}"
        )
    return await generate_and_score(
        engine,
        tokenizer,
        cfg.data,
        cfg.eval,
        cfg.generation.max_tokens,
        cfg.engine.max_model_len,
        records,
        rewards,
        ref.version,
        episodes=EpisodeRun(load_episode(cfg.episode.fn), cfg.episode, cfg.rewards.on_failure)
        if cfg.episode.fn
        else None,
    )


def _reward_cluster(cfg: RunConfig) -> Any:
    """The replicas of the run's ``executor: ray`` rewards, on the cluster at
    ``launch.ray_address`` (None when no reward uses Ray)."""
    ray_specs = [i for i, s in enumerate(cfg.rewards.specs) if s.executor == "ray"]
    if not ray_specs:
        return None
    if not cfg.launch.ray_address:
        raise ConfigError(
            f"rewards.specs[{ray_specs[0]}].executor: ray rewards run on a Ray cluster; give "
            "one with --set launch.ray_address=HOST:PORT"
        )
    from pipeline.launch.ray_cluster import RewardCluster

    return RewardCluster(cfg)


def main(argv: list[str]) -> int:
    """Run the subcommand; bad input (options, or a checkpoint it cannot read) exits 2 with one
    line, before any engine starts."""
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pipeline-eval-") as tmp:
        from pipeline.learner.checkpoint import CheckpointError

        try:
            ckpt = resolve_checkpoint(Path(args.checkpoint))
            cfg = config_for(ckpt, args.config, args.set)
            if not cfg.eval.data:
                raise ConfigError("eval.data: name the held-out prompts (--set eval.data=FILE)")
            from pipeline.launch.preflight import prepare
            from pipeline.producer.evaluation import eval_records

            model_path = prepare(cfg, role="producer")
            eval_records(cfg.data, cfg.eval)  # a bad eval.data fails here, before any engine
            ref, state, kind = checkpoint_snapshot(cfg, model_path, ckpt, Path(tmp))
            reward_cluster = _reward_cluster(cfg)
        except ConfigError as e:
            print(f"pipeline-train eval: config error: {e}", file=sys.stderr)
            return 2
        except CheckpointError as e:
            print(f"pipeline-train eval: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
        print(f"checkpoint {ckpt} (step {state.step}, version {state.version}): {kind}")
        from pipeline.launch.console import console_to_log
        from pipeline.procs import log_file, setup_logging

        setup_logging()  # our records in the format the console's filter reads
        try:
            with console_to_log(log_file(ckpt.parent.parent, "eval"), args.verbose):
                stats = asyncio.run(_evaluate(cfg, model_path, ref))
        finally:
            if reward_cluster is not None:
                reward_cluster.stop()
    result = {"checkpoint": str(ckpt), "step": state.step, "version": state.version, **stats}
    out = Path(args.out) if args.out else ckpt / "eval.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    k = cfg.eval.samples_per_prompt
    print(
        f"eval {ckpt} (step {state.step}): reward_mean {stats['eval/reward_mean']:.4f}, "
        f"pass@{k} {stats[f'eval/pass@{k}']:.4f} over {int(stats['eval/prompts'])} prompts "
        f"x {k} samples"
    )
    for key, value in stats.items():
        print(f"  {key}: {value:.6g}")
    print(f"written: {out}")
    return 0
