"""Loading a reward from its ``RewardSpec``: the ``@reward`` decorator's defaults, importing a
function or class named by ``module:name`` or ``file.py:name``, its effective name, weight and
calling convention, and building it once into a ``Scorer``.

Invariants: importing a reward never builds it (``describe`` and ``validate_specs`` are cheap and
run at launch, before any process starts); a class is built once per process that calls it (the
producer, each process pool worker, each Ray replica) with the spec's ``kwargs``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pipeline.config import RewardSpec

CallMode = Literal["single", "batched", "trl"]
"""How a reward is called: per completion, per group (native ``batched``), or TRL's way."""

# Parameter names that tell a TRL-style reward from a native one (style: auto).
_TRL_NAMES = frozenset(("completions", "completion_ids"))
_NATIVE_NAMES = frozenset(("completion", "metas"))


def reward(
    fn: Any = None, *, name: str | None = None, batched: bool = False, weight: float = 1.0
) -> Any:
    """Attach defaults (name, batched, weight) to a reward function or class.

    Usable bare (``@reward``) or with arguments (``@reward(batched=True)``). A ``RewardSpec``
    field that is set explicitly wins over these defaults.
    """

    def attach(obj: Any) -> Any:
        obj.__reward_defaults__ = {"name": name, "batched": batched, "weight": weight}
        return obj

    return attach(fn) if fn is not None else attach


def load_callable(path: str) -> Any:
    """Import ``package.module:attr`` or ``path/to/file.py:attr`` and return the attribute."""
    module_part, sep, attr = path.rpartition(":")
    if not sep or not module_part or not attr:
        raise ValueError(
            f"reward path {path!r} must look like 'package.module:attr' or 'path/to/file.py:attr'"
        )
    module = _load_file(path, module_part) if module_part.endswith(".py") else None
    if module is None:
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


def _load_file(path: str, module_part: str) -> Any:
    """The module of a ``file.py``, imported once per process under a stable per-file name, so
    repeated loads (and pickling by reference inside the same process) see one module object."""
    file = Path(module_part).expanduser().resolve()
    if not file.is_file():
        raise ImportError(f"reward path {path!r}: file {file} does not exist")
    mod_name = f"_reward_file_{hashlib.sha1(str(file).encode()).hexdigest()[:12]}"
    module = sys.modules.get(mod_name)
    if module is not None:
        return module
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
    return module


def resolve(spec: RewardSpec) -> Any:
    """The spec's function or class: imported from its path, or the object the spec holds."""
    return load_callable(spec.fn) if isinstance(spec.fn, str) else spec.fn


@dataclass(frozen=True)
class RewardInfo:
    """What a spec resolves to, before anything is built."""

    obj: Any
    """The function or class (not yet instantiated)."""
    name: str
    """Explicit spec field > ``@reward`` default > the attribute's name."""
    batched: bool
    weight: float
    mode: CallMode


def describe(spec: RewardSpec) -> RewardInfo:
    """Import the spec's reward and work out its effective name, weight and convention."""
    obj = resolve(spec)
    deco = getattr(obj, "__reward_defaults__", {})
    if isinstance(spec.fn, str):
        fallback_name = spec.fn.rpartition(":")[2]
    else:
        fallback_name = getattr(obj, "__name__", type(obj).__name__)
    name = spec.name or deco.get("name") or fallback_name
    batched = spec.batched if spec.batched is not None else bool(deco.get("batched", False))
    weight = spec.weight if spec.weight is not None else float(deco.get("weight", 1.0))
    return RewardInfo(obj, name, batched, weight, call_mode(spec, obj, batched))


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


@dataclass(frozen=True)
class Scorer:
    """A built reward, ready to be called (``pipeline.producer.rewards.call``)."""

    fn: Callable[..., Any]
    """The function, or the instance of the user's class."""
    accepts: frozenset[str] | None
    """Keywords it accepts; None when it takes ``**meta`` (everything is passed)."""
    mode: CallMode


def build_scorer(fn: Any, kwargs: dict[str, Any], mode: CallMode) -> Scorer:
    """Build a reward once: ``fn`` is the function or class, or its import path (a process pool
    worker or a Ray replica imports it itself). Classes are instantiated with ``kwargs``."""
    obj = load_callable(fn) if isinstance(fn, str) else fn
    scorer = obj(**kwargs) if inspect.isclass(obj) else obj
    return Scorer(scorer, _accepted_keywords(scorer), mode)


def _accepted_keywords(scorer: Callable[..., Any]) -> frozenset[str] | None:
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


def validate_specs(specs: list[RewardSpec]) -> None:
    """Import every reward now and check names are unique, so bad config fails before any
    process starts. Classes are not instantiated here (that may be expensive)."""
    seen: set[str] = set()
    for spec in specs:
        info = describe(spec)
        if info.name in seen:
            raise ValueError(
                f"duplicate reward name {info.name!r}; set RewardSpec.name to tell them apart"
            )
        seen.add(info.name)
        if spec.executor == "process" and not isinstance(spec.fn, str):
            qual = getattr(info.obj, "__qualname__", "")
            if "<locals>" in qual or "<lambda>" in qual:
                raise ValueError(
                    f"reward {info.name!r} runs in a process but {qual} cannot be "
                    "pickled; give its import path instead"
                )
