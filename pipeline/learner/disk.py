"""Disk space for checkpoints: what a checkpoint of a model will take, what the run's disk has
free, and the one-line refusal when ``train.keep_checkpoints`` + 1 of them do not fit.

No torch here: the launcher checks space (``pipeline.launch.preflight``) before any process
starts, from the model's ``config.json``, so a full disk is a message, not a crash at the
first checkpoint. The learner reports ``checkpoint_disk_free_gb`` from ``disk_free`` every step.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

STEP_DIR = re.compile(r"^step_(\d+)(?:-(\d+))?$")  # step_<N>, or a rewrite of N: step_<N>-<k>


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of each checkpoint directory under ``root`` (run_dir/checkpoints)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return [(int(m.group(1)), p) for p in root.iterdir()
            if (m := STEP_DIR.match(p.name)) and p.is_dir()]


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def disk_free(path: Path) -> int:
    """Bytes free on the filesystem of ``path`` (its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def estimate_checkpoint_bytes(params: int, trainable: int, deepspeed: bool = False) -> int:
    """A checkpoint's bytes: fp32 weights (4 per parameter) and AdamW's two fp32 moments (8 per
    trainable one); DeepSpeed's files add its bf16 module weights (2 per parameter)."""
    return 4 * params + 8 * trainable + (2 * params if deepspeed else 0)


def trainable_parameters(hf: dict[str, Any], params: int, lora: bool, freeze_layers: int) -> int:
    """Parameters the optimiser holds state for: all of them; none of the base under LoRA (its
    adapters are small); ``freeze_layers`` leaves out the embeddings and that share of the
    decoder layers."""
    if lora:
        return 0
    if not freeze_layers:
        return params
    text = hf.get("text_config") or {}
    get = lambda k, d=None: hf.get(k, text.get(k, d))  # noqa: E731 (multimodal configs nest)
    layers = int(get("num_hidden_layers"))
    embed = int(get("vocab_size")) * int(get("hidden_size"))
    tied = bool(get("tie_word_embeddings", False))
    decoder = params - embed * (1 if tied else 2)
    frozen = embed + decoder * min(freeze_layers, layers) // layers
    return max(0, params - frozen)


def space_shortfall(run_dir: Path, each: int, keep: int, free: int | None = None,
                    final_only: bool = False, own_checkpoints: bool = True) -> str | None:
    """None if ``keep`` + 1 checkpoints of ``each`` bytes fit under ``run_dir`` (the kept ones
    and the one written beside them before the oldest goes), else the one-line reason naming
    bytes needed, bytes free, run_dir and train.keep_checkpoints. ``final_only``: the run
    writes no checkpoint before its final one (no ``checkpoint_every``, no elastic producers),
    so one more beside those held is the peak. ``own_checkpoints``: the checkpoints already
    there are this run's (``--resume``: it removes them as it writes, so they count as
    written); False for a fresh run, whose launcher sets an earlier run aside on the same disk,
    where its checkpoints keep their bytes."""
    held = sorted(step_dirs(Path(run_dir) / "checkpoints"))[-keep:] if own_checkpoints else []
    have = sum(dir_bytes(p) for _s, p in held)
    need = each if final_only else max(0, (keep + 1) * each - have)
    # The checkpoints' own filesystem: run_dir/checkpoints may be a mount or link elsewhere.
    free = disk_free(Path(run_dir) / "checkpoints") if free is None else free
    if need <= free:
        return None
    already = f", less {have} bytes of checkpoints already there" if have else ""
    size = f"{each / 1e9:.1f} GB" if each >= 1e8 else f"{each / 1e6:.1f} MB"
    if final_only:
        return (f"the final checkpoint needs {need} bytes free under run_dir {run_dir} but "
                f"{free} bytes are free (about {size}); free space or choose another run_dir")
    return (f"checkpoints need {need} bytes free under run_dir {run_dir} but {free} bytes are "
            f"free: train.keep_checkpoints {keep} kept + 1 being written, about {size} "
            f"each{already}; lower train.keep_checkpoints, free space or choose another run_dir")


def check_run_space(cfg: Any, model_path: str, own_checkpoints: bool = True) -> str | None:
    """``space_shortfall`` for a run's config (``RunConfig``) and model directory, estimated
    from its ``config.json``; None when it has none (a model this cannot size). A launcher
    passes ``own_checkpoints=False`` for a fresh run (no ``--resume``)."""
    import json

    from pipeline.memory import learner_setup, model_parameters

    conf = Path(model_path) / "config.json"
    if not conf.is_file():
        return None
    t = cfg.train
    try:
        hf = json.loads(conf.read_text())
        params = model_parameters(hf)
        trainable = trainable_parameters(hf, params, t.lora_rank > 0, t.freeze_layers)
    except (ValueError, KeyError, TypeError):
        return None
    ds = learner_setup(t.accelerate_config, t.learner_processes, t.lora_rank > 0).zero_stage > 0
    run_dir = Path(cfg.run_dir or f"runs/{cfg.name}")
    final_only = t.checkpoint_every == 0 and cfg.max_producers == 0
    return space_shortfall(run_dir, estimate_checkpoint_bytes(params, trainable, ds),
                           t.keep_checkpoints, final_only=final_only,
                           own_checkpoints=own_checkpoints)
