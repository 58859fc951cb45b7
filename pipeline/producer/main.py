"""The producer role's entry point: the process a launcher starts for engine ``index`` (the
local supervisor's child, a Ray actor's child), a producer or, at the dedicated evaluator's
index, the evaluator (``pipeline.schedule.is_evaluator``)."""

from __future__ import annotations

import asyncio
import logging
import os

from pipeline.config import flatten, load_config
from pipeline.procs import child_setup, run_with_sigterm
from pipeline.schedule import display_name, is_evaluator, process_name

log = logging.getLogger("pipeline")


def producer_entry(cfg_dict: dict, model_path: str, index: int, gpu_env: dict[str, str],
                   standalone: bool = False, log_to_file: bool = False) -> None:
    """Producer ``index``, or the dedicated evaluator when ``index`` is its. ``gpu_env`` pins it
    to its GPUs before the config is built (nothing may initialise CUDA before the pin);
    ``standalone`` (``--role producer``): it exits once the learner has trained its last step,
    as no launcher stops it."""
    child_setup(cfg_dict["run_dir"], process_name(cfg_dict, index), log_to_file)
    os.environ.update(gpu_env)
    cfg = load_config(overrides=flatten(cfg_dict))
    from pipeline.producer.evaluation import evaluator_main
    from pipeline.producer.loop import producer_main

    if is_evaluator(cfg_dict, index):
        main = evaluator_main(cfg, index, model_path, index + 1,
                              stop_when_learner_done=standalone)
    else:
        main = producer_main(cfg, index, model_path, stop_when_learner_done=standalone)
    try:
        asyncio.run(run_with_sigterm(main))
    except (KeyboardInterrupt, asyncio.CancelledError):
        log.info("%s stopped", display_name(cfg_dict, index))
