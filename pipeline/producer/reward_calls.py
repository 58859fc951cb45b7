"""Loading a reward and calling it in its convention: a function or class named by
``module:name`` or ``file.py:name``, its decorator defaults, whether it is called per completion,
per group or TRL's way, and one blocking call of it. Shared by the reward set's executors in this
process, its process pool and the Ray reward replicas (``ray_rewards``)."""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pipeline.config import RewardSpec

CallMode = Literal["single", "batched", "trl"]
# Parameter names that tell a TRL-style reward from a native one (style: auto).
_TRL_NAMES = frozenset(("completions", "completion_ids"))
_NATIVE_NAMES = frozenset(("completion", "metas"))


def load_callable(path: str) -> Any:
    """Import ``package.module:attr`` or ``path/to/file.py:attr`` and return the attribute."""
    module_part, sep, attr = path.rpartition(":")
    if not sep or not module_part or not attr:
        raise ValueError(
            f"reward path {path!r} must look like 'package.module:attr' or 'path/to/file.py:attr'"
        )
    if module_part.endswith(".py"):
        file = Path(module_part).expanduser().resolve()
        if not file.is_file():
            raise ImportError(f"reward path {path!r}: file {file} does not exist")
        # A stable per-file module name, so repeated loads (and pickling by reference inside the
        # same process) see one module object.
        mod_name = f"_reward_file_{hashlib.sha1(str(file).encode()).hexdigest()[:12]}"
        module = sys.modules.get(mod_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(mod_name, file)
            if spec is None or spec.loader is None:
                raise ImportError(f"reward path {path!r}: cannot load {file} as a module")
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException as e:
                del sys.modules[mod_name]
                raise ImportError(f"reward path {path!r}: importing {file} failed: {e!r}") from e
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as e:
            raise ImportError(
                f"reward path {path!r}: cannot import module {module_part!r}: {e}"
            ) from e
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ImportError(
            f"reward path {path!r}: module {module_part!r} has no attribute {attr!r}"
        ) from None
    if not callable(obj):
        raise ValueError(
            f"reward path {path!r} names {type(obj).__name__}, not a function or class"
        )
    return obj


def _resolve_obj(spec: RewardSpec) -> Any:
    return load_callable(spec.fn) if isinstance(spec.fn, str) else spec.fn


def _defaults(spec: RewardSpec, obj: Any) -> dict[str, Any]:
    """Effective name/batched/weight: explicit spec field > @reward default > built-in."""
    deco = getattr(obj, "__reward_defaults__", {})
    if isinstance(spec.fn, str):
        fallback_name = spec.fn.rpartition(":")[2]
    else:
        fallback_name = getattr(obj, "__name__", type(obj).__name__)
    name = spec.name or deco.get("name") or fallback_name
    batched = spec.batched if spec.batched is not None else bool(deco.get("batched", False))
    weight = spec.weight if spec.weight is not None else float(deco.get("weight", 1.0))
    return {"name": name, "batched": batched, "weight": weight}


def _param_names(obj: Any) -> frozenset[str] | None:
    """Named parameters of a function, or of a class's ``__call__`` (None: no signature)."""
    target = obj.__call__ if inspect.isclass(obj) else obj
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return None
    if inspect.isclass(obj) and params and params[0].name == "self":
        params = params[1:]
    return frozenset(
        p.name
        for p in params
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    )


def call_mode(spec: RewardSpec, obj: Any, batched: bool) -> CallMode:
    """How a reward is called: per completion, batched (native), or TRL-style per group.

    ``style: auto`` picks trl for a signature naming ``completions`` or ``completion_ids`` and
    neither ``completion`` nor ``metas`` (TRL's documented shape), unless batched is set.
    """
    if spec.style == "trl":
        return "trl"
    if spec.style == "auto" and not batched:
        names = _param_names(obj)
        if names is not None and names & _TRL_NAMES and not names & _NATIVE_NAMES:
            return "trl"
    return "batched" if batched else "single"


def trl_kwargs(
    prompt: Any,
    completions: list[str],
    metas: list[dict[str, Any]],
    completion_ids: list[list[int]] | None,
) -> dict[str, Any]:
    """The keywords TRL's GRPOTrainer passes a reward function, for one group of n completions.

    ``prompts`` and ``completions`` are lists of strings, or for a conversational prompt (a list
    of messages) the prompt's messages and ``[{"role": "assistant", "content": text}]`` per
    completion; ``completion_ids`` the sampled token ids; every other key of the metas (the
    dataset's columns, ``prompt_id``, ``completion_index``) a list with one entry per completion.
    """
    n = len(completions)
    conversational = isinstance(prompt, list)
    kw: dict[str, Any] = {
        "prompts": [prompt] * n,
        "completions": [[{"role": "assistant", "content": c}] for c in completions]
        if conversational
        else list(completions),
    }
    if completion_ids is not None:
        kw["completion_ids"] = [[int(t) for t in ids] for ids in completion_ids]
    for key in metas[0] if metas else ():
        if key not in kw:
            kw[key] = [m.get(key) for m in metas]
    return kw


def _instantiate(obj: Any, kwargs: dict[str, Any]) -> Callable[..., Any]:
    """Classes are built once with kwargs; functions are used as they are."""
    return obj(**kwargs) if inspect.isclass(obj) else obj


def _meta_filter(scorer: Callable[..., Any]) -> frozenset[str] | None:
    """Names of keyword arguments the scorer accepts, or None when it takes ``**meta``."""
    try:
        params = inspect.signature(scorer).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )


def _invoke(
    scorer: Callable[..., Any],
    accepts: frozenset[str] | None,
    mode: CallMode,
    args: tuple[Any, ...],
) -> Any:
    """Call a scorer; the result may be a value or an awaitable."""
    if mode == "batched":
        return scorer(*args)
    if mode == "trl":
        (kw,) = args
        if accepts is not None:
            kw = {k: v for k, v in kw.items() if k in accepts}
        return scorer(**kw)
    prompt, completion, meta = args
    if accepts is not None:
        meta = {k: v for k, v in meta.items() if k in accepts}
    return scorer(prompt, completion, **meta)


def _run_blocking(
    scorer: Callable[..., Any],
    accepts: frozenset[str] | None,
    mode: CallMode,
    args: tuple[Any, ...],
) -> Any:
    """Thread/process side: call, and drive an async scorer to completion on a private loop."""
    out = _invoke(scorer, accepts, mode, args)
    if inspect.isawaitable(out):

        async def await_it() -> Any:
            return await out

        out = asyncio.run(await_it())
    return out
