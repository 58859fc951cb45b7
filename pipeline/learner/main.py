"""The learner role's entry points: ``learner_entry``, the process a launcher starts (the local
supervisor's child, a Ray actor's child), and ``main``, every rank of a learner started by
``accelerate launch`` (``train.learner_processes`` > 1 or a ``train.accelerate_config``):
``python -m pipeline.learner.main CONFIG.yaml --model DIR`` (``--resume`` to continue from the
last checkpoint).

Under accelerate, rank 0 runs the whole Learner (I/O, buffer, snapshots, checkpoints, metrics);
the other ranks only build the PolicyTrainer and follow rank 0's commands. The other ranks ignore
SIGINT: a stop reaches the whole process group, and rank 0 still needs them for its final
checkpoint; it releases them when it is done (and accelerate's launcher stops them with SIGTERM if
rank 0 dies).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path

import yaml

from pipeline.config import flatten, load_config
from pipeline.learner import distributed as D
from pipeline.procs import child_setup, run_with_sigterm, setup_logging

log = logging.getLogger("pipeline")


def learner_entry(cfg_dict: dict, model_path: str, resume: bool, gpu_env: dict[str, str],
                  log_to_file: bool = False) -> None:
    """The learner process of a launcher: ``gpu_env`` pins it to its GPUs (the launcher's
    placement) before the config is built, as nothing may initialise CUDA before the pin."""
    child_setup(cfg_dict["run_dir"], "learner", log_to_file)
    os.environ.update(gpu_env)
    cfg = load_config(overrides=flatten(cfg_dict))
    if cfg.train.expandable_segments and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        # Read by the CUDA caching allocator when it starts: before anything touches CUDA.
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    from pipeline.learner.loop import Learner
    from pipeline.learner.oom import MemoryFloorError

    try:
        asyncio.run(run_with_sigterm(Learner(cfg, model_path, resume=resume).run()))
    except (KeyboardInterrupt, asyncio.CancelledError):
        log.info("learner stopped")
    except MemoryFloorError:  # its one line is logged where it was raised
        raise SystemExit(1) from None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("config", help="the run's config.yaml (as written to run_dir)")
    p.add_argument("--model", required=True, help="resolved local model directory")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    setup_logging()
    cfg = load_config(overrides=flatten(yaml.safe_load(Path(args.config).read_text())))
    if not D.is_main():
        from pipeline.learner.trainer import PolicyTrainer

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        PolicyTrainer(cfg, args.model).follow()
        D.shutdown()
        return
    from pipeline.learner.loop import Learner
    from pipeline.learner.oom import MemoryFloorError

    learner = Learner(cfg, args.model, resume=args.resume)
    try:
        asyncio.run(run_with_sigterm(learner.run()))
    except (KeyboardInterrupt, asyncio.CancelledError):
        log.info("learner stopped")
    except MemoryFloorError:  # its one line is logged where it was raised
        raise SystemExit(1) from None
    finally:
        if learner.final_checkpoint_failed and D.world_size() > 1:
            end_every_rank()
        learner.trainer.release_followers()
        D.shutdown()


def end_every_rank() -> None:
    """The final checkpoint of a multi-rank learner failed part-way (e.g. a collective failed
    on a full GPU): the other ranks may be inside a collective that will never complete, and
    releasing them would be one more collective, which then hangs until the process group's
    timeout. Exit at once with code 1: accelerate's launcher then stops the other ranks, and the
    run keeps its previous checkpoint."""
    log.error("the final checkpoint failed on a learner of %d ranks: ending every rank now "
              "(the previous checkpoint is kept)", D.world_size())
    logging.shutdown()
    os._exit(1)


if __name__ == "__main__":
    main()
