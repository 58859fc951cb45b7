"""The machinery behind the config dataclasses: fields with numeric bounds, checking a value
against its annotation, building sections from YAML mappings and dotted overrides, and walking
the declarations (each field's docstring is its help text) for ``--help``.

It knows nothing of any particular option: ``pipeline.config`` declares them and passes its
root class where a walk needs one. Invariants: every value a config holds has been checked
against its field's annotation (``coerce``) and declared bounds, and is a plain builtin that
YAML and msgpack carry unchanged; every error is one ``ConfigError`` whose message starts with
the option's dotted name. A renamed option keeps its old name as an alias (``opt(was=...)``): a
mapping or override that uses it still builds, with one deprecation line naming the new one.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import logging
import math
import numbers
import operator
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import field
from pathlib import Path
from typing import Any, Literal

import yaml

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A bad configuration value; the message names the option."""


def opt(default: Any = dataclasses.MISSING, *, gt: float | None = None,
        ge: float | None = None, lt: float | None = None, le: float | None = None,
        was: str = "", **kw: Any) -> Any:
    """A dataclass field with numeric bounds (``ge=1``: must be >= 1), checked by ``enforce``
    after the field's type; a list or dict default is copied for each instance. ``was``: the
    option's former name in its section, still accepted (``build``) with a deprecation line."""
    meta: dict[str, Any] = {k: v for k, v in (("gt", gt), ("ge", ge), ("lt", lt), ("le", le))
                            if v is not None}
    if was:
        meta["was"] = was
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def check(cond: bool, option: str, msg: str) -> None:
    """A rule the annotation and bounds cannot say (a pattern, a relation between options)."""
    if not cond:
        raise ConfigError(f"{option}: {msg}")


# ---------------------------------------------------------------- types

_INT_RANGE = (-(2**63), 2**63 - 1)  # ints reach vLLM, torch and ZeroMQ as C integers


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def is_section(tp: Any) -> bool:
    """Whether annotation ``tp`` is a nested config dataclass (a section, not a value)."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe_type(tp: Any) -> str:
    """What a value of annotation ``tp`` looks like, in words (error messages, --help)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in args)
    if origin is Literal:
        names = [str(a) for a in args]
        return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
    return {bool: "true or false", int: "an integer", float: "a finite number",
            str: "a string", type(None): "null", list: "a list", dict: "a mapping",
            Callable: "a callable"}.get(origin or tp, "a mapping" if is_section(tp)
                                        else getattr(tp, "__name__", str(tp)))


def _plain(value: Any) -> Any:
    """A scalar of a type that stands for a str, bool, int or float (a str subclass such as
    ``np.str_``, numpy's ``bool_``, ``int64``, ``float32`` ...) as that builtin, so that the
    checks see one type per kind and the config stays YAML- and msgpack-safe; anything else
    unchanged. numpy is recognised by the abstract number types it registers (and a ``bool_``
    by its dtype), never imported."""
    if type(value) in (str, bool, int, float) or value is None:
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if getattr(getattr(value, "dtype", None), "kind", None) == "b":
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def _coerce_scalar(value: Any, tp: type, option: str, bad: ConfigError) -> Any:
    """``coerce`` for bool, int, float and str."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if isinstance(value, bool):
        raise bad  # a bool is an int to Python, never a number or a string to a config
    if tp is int:
        if not isinstance(value, int):
            raise bad
        if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            raise ConfigError(f"{option}: {value} is out of range (64-bit integers)")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 5e-5 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{option}: expected a number, got {_short(value)}") from None
        if isinstance(value, int):
            try:
                value = float(value)
            except OverflowError:
                raise bad from None
        if not isinstance(value, float) or not math.isfinite(value):
            raise bad
        return value
    if isinstance(value, int):
        return str(value)  # YAML reads a GPU index or a numeric name as an int
    if not isinstance(value, str):
        raise bad
    if "\0" in value:
        raise ConfigError(f"{option}: must not contain a NUL character")
    return value


def coerce(value: Any, tp: Any, option: str) -> Any:
    """``value`` checked against the annotation ``tp``; returns it, converted where that loses
    nothing (an int for a float, a YAML 1.1 string like ``5e-5`` for a float, an int for a
    string such as a GPU index, a mapping for a nested section, a str subclass or a numpy
    scalar for the builtin it stands for). Raises ConfigError naming ``option`` and what it
    accepts."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = ConfigError(f"{option}: expected {describe_type(tp)}, got {_short(value)}")
    if tp is Any:
        return value
    value = _plain(value)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if value is None:
            if len(members) < len(args):
                return None
            raise bad
        for member in members:
            try:
                return coerce(value, member, option)
            except ConfigError as e:
                if len(members) == 1:
                    raise e from None  # one real type: its own message is the clearest
        raise bad
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise ConfigError(f"{option}: must be {describe_type(tp)}, got {_short(value)}")
    if tp in (bool, int, float, str):
        return _coerce_scalar(value, tp, option, bad)
    if tp is list or origin is list:
        if not isinstance(value, list):
            raise bad
        return [coerce(v, args[0], f"{option}[{i}]") for i, v in enumerate(value)] if args \
            else value
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise bad
        if args and args[0] is str and not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{option}: keys must be strings, got {_short(list(value))}")
        return value
    if origin is Callable:
        if callable(value):
            return value
        raise bad
    if is_section(tp) and isinstance(value, dict):
        return build(tp, value, option)
    if isinstance(tp, type) and not isinstance(value, tp):
        raise bad
    return value


def _check_bounds(value: Any, meta: Any, option: str) -> None:
    """Numeric bounds declared on a field (``opt(..., ge=1)``); a lower and an upper bound
    together read as an interval, ``in (0, 1]``."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    low = next(((k, meta[k]) for k in ("gt", "ge") if k in meta), None)
    high = next(((k, meta[k]) for k in ("lt", "le") if k in meta), None)
    ok = {"gt": operator.gt, "ge": operator.ge, "lt": operator.lt, "le": operator.le}
    if all(ok[k](value, bound) for k, bound in filter(None, (low, high))):
        return
    if low and high:
        want = (f"in {'(' if low[0] == 'gt' else '['}{low[1]}, "
                f"{high[1]}{')' if high[0] == 'lt' else ']'}")
    else:
        key, bound = low or high  # type: ignore[misc]
        want = f"{dict(gt='>', ge='>=', lt='<', le='<=')[key]} {bound}"
    raise ConfigError(f"{option}: must be {want}, got {value}")


def enforce(obj: Any, section: str = "") -> None:
    """Check every field of config dataclass ``obj`` against its annotation and declared bounds,
    storing converted values; the first thing each config ``__post_init__`` does. Messages
    name the option as ``section.field`` (a list entry's section is put in front by
    ``build``)."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        name = f"{section}.{f.name}" if section else f.name
        value = coerce(getattr(obj, f.name), hints[f.name], name)
        _check_bounds(value, f.metadata, name)
        object.__setattr__(obj, f.name, value)  # also for frozen dataclasses


# ---------------------------------------------------------------- building, YAML

def _prefixed(prefix: str, message: str) -> str:
    if not prefix or message.startswith((f"{prefix}.", f"{prefix}:", f"{prefix}[")):
        return message
    return f"{prefix}.{message}" if not message.startswith(" ") else f"{prefix}:{message}"


def _renamed(cls: type) -> dict[str, str]:
    """{former name: name} of the fields of config dataclass ``cls`` declared with ``was``."""
    return {f.metadata["was"]: f.name for f in dataclasses.fields(cls) if "was" in f.metadata}


def _dotted(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _deprecated(old: str, new: str) -> None:
    log.warning("option %s is deprecated: it is now %s", old, new)


def _rename(cls: type, data: dict, prefix: str) -> dict:
    """``data`` with each former option name of ``cls`` replaced by its name, one deprecation
    line each; both names set at once is a ConfigError."""
    for old, new in _renamed(cls).items():
        if old not in data:
            continue
        if new in data:
            raise ConfigError(f"{_dotted(prefix, old)}: renamed {_dotted(prefix, new)}, which "
                              f"is set too; keep {_dotted(prefix, new)} only")
        _deprecated(_dotted(prefix, old), _dotted(prefix, new))
        data = {(new if k == old else k): v for k, v in data.items()}
    return data


def renamed_options(cls: type, prefix: str = "") -> dict[str, str]:
    """{former dotted name: dotted name} of every renamed leaf option under ``cls``, for the
    CLI's ``--set`` and flags (their values are parsed as the new option's)."""
    hints = _hints(cls)
    out = {_dotted(prefix, old): _dotted(prefix, new) for old, new in _renamed(cls).items()}
    for f in dataclasses.fields(cls):
        if is_section(hints[f.name]):
            out.update(renamed_options(hints[f.name], _dotted(prefix, f.name)))
    return out


def build(cls: type, data: Any, prefix: str = "") -> Any:
    """A config dataclass from a mapping; every error names the option under ``prefix``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {_short(data)}")
    data = _rename(cls, data, prefix)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in data if k not in names)
    if unknown:
        raise ConfigError(f"{prefix or 'config'}: unknown option(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(names))}")
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = coerce(data[f.name], hints[f.name],
                                    f"{prefix}.{f.name}" if prefix else f.name)
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix or 'config'}: missing {', '.join(missing)}")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(_prefixed(prefix, str(e))) from None


def read_yaml(path: str | Path) -> Any:
    """A YAML file's data; a missing, unreadable or malformed file is one ConfigError naming the
    file (and the line, for a syntax error)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} " + ("is not a file" if p.exists() else
                                                 "does not exist"))
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p}: cannot read it: {e}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {p}{where}: invalid YAML: {what}") from None


def load(cls: type, path: str | Path | None = None,
         overrides: dict[str, Any] | None = None) -> Any:
    """YAML file (optional) + dotted overrides ``{"train.lr": 1e-5}`` -> validated ``cls``. An
    override wins over the file's value of its option, under either of a renamed option's
    names."""
    data: Any = {}
    if path is not None:
        data = read_yaml(path)
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: top level must be a mapping of options, "
                              f"got {type(data).__name__}")
    renamed = renamed_options(cls)
    former = {new: old for old, new in renamed.items()}
    for key, value in (overrides or {}).items():
        if key in renamed:
            _deprecated(key, renamed[key])
            key = renamed[key]
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {part} is not a section")
        node[parts[-1]] = value
        if key in former:
            node.pop(former[key].rsplit(".", 1)[-1], None)
    return build(cls, data)


def to_dict(cfg: Any) -> Any:
    """Plain dict (YAML/msgpack-safe) of a config, for run_dir/config.yaml and child processes."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, list):
        return [to_dict(x) for x in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def flatten(d: dict, cls: type, prefix: str = "") -> dict[str, Any]:
    """A nested config dict as dotted ``section.key`` overrides; only sections (nested config
    dataclasses of ``cls``) are opened, a mapping-valued option such as ``engine.extra`` stays
    one value."""
    hints = _hints(cls)
    out: dict[str, Any] = {}
    for k, v in d.items():
        tp = hints.get(k)
        if isinstance(v, dict) and tp is not None and is_section(tp):
            out.update(flatten(v, tp, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ---------------------------------------------------------------- declarations, for the CLI

def _leaves(cls: type, prefix: str = ""):
    """Yield (dotted_name, owning dataclass, field, type) for every leaf option."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        if is_section(hints[f.name]):
            yield from _leaves(hints[f.name], name + ".")
        else:
            yield name, cls, f, hints[f.name]


def iter_options(cls: type, prefix: str = ""):
    """Yield (dotted_name, field, type) for every leaf option: the CLI's source of flags."""
    for name, _owner, f, tp in _leaves(cls, prefix):
        yield name, f, tp


@functools.cache
def _module_field_docs(module: str) -> dict[str, dict[str, str]]:
    """{class name: {field: docstring}} for every class of ``module``, read from its source in
    one parse (``inspect.getsource`` of each class would parse the module once per class);
    {} when the source is not available."""
    try:
        tree = ast.parse(inspect.getsource(sys.modules[module]))
    except (OSError, TypeError, SyntaxError, KeyError):
        return {}
    out: dict[str, dict[str, str]] = {}
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        docs = out.setdefault(cls.name, {})
        for node, nxt in itertools.pairwise(cls.body):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split()).replace("``", "")
    return out


def _field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under a dataclass's fields (one per field: each option's help
    text)."""
    return _module_field_docs(cls.__module__).get(cls.__qualname__, {})


def iter_help(cls: type, prefix: str = ""):
    """Yield (dotted_name, type, default, help) for every leaf option, for ``--help``."""
    for name, owner, f, tp in _leaves(cls, prefix):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        yield name, tp, default, _field_docs(owner).get(f.name, "")


def parse_value(text: str, tp: Any, option: str) -> Any:
    """Parse a CLI string for an option of type ``tp`` (YAML syntax for lists/dicts/None);
    the type itself is checked when the config is built."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{option}: cannot parse {_short(text)}: {what}") from None
    members = set(typing.get_args(tp)) if typing.get_origin(tp) in (
        typing.Union, types.UnionType) else {tp}
    if str in members and not isinstance(value, str) and (
            value is not None or type(None) not in members):
        # A string option keeps what was typed (`--name 007`, `--data.path 1.5`, and `''` or
        # nothing for an empty one such as `--learner_gpus ''`); null only unsets an optional one.
        value = text
    if typing.get_origin(tp) is Literal:
        value = text
    return value
