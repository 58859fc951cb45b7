"""Prompt sources for producers: JSONL/JSON, Parquet, CSV, a `datasets` dir on disk, or synthetic
arithmetic; and rendering a prompt (plain or conversational) to token ids.

The run reads one sequence of prompts: each epoch a seeded permutation of every record. The
learner leases ranges of it to producers (``pipeline.learner.roster``), each position to one
producer, so every prompt is read once per epoch however producers join, leave or restart; a
producer's cursor counts what it read over its leases, and the learner records and checkpoints
the highest cursor it received per producer (where a restarted producer resumes).

A record's prompt (``data.prompt_field``) is a string or a conversation: a list of
``{"role": ..., "content": ...}`` messages, rendered with the model's chat template. Every
other field reaches the rewards (``meta`` / TRL kwargs); ``data.answer_field`` names the one
given to them as ``answer``.
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import DataConfig
from pipeline.options import ConfigError

FORMATS = (
    "a .jsonl/.json, .parquet or .csv file, a `datasets` dir saved with save_to_disk, "
    "or 'arithmetic:N[:MAX_OPERAND]'"
)


@dataclass
class PromptRecord:
    prompt_id: str
    prompt: str | list[dict[str, Any]]  # text, or a conversation (list of messages)
    meta: dict[str, Any]  # every other field of the record (e.g. "answer"), for rewards
    cursor: int  # positions this producer has read, this one included (resume point)
    position: int = -1  # where in the run's prompt sequence (epoch * records + place)


def load_records(path: str) -> list[dict[str, Any]]:
    """All records of a source, in file order. Raises ConfigError with the path on failure."""
    if path.startswith("arithmetic:"):
        from pipeline.tasks.arithmetic import make_arithmetic_prompts

        try:
            n, *rest = (int(x) for x in path.split(":")[1:])
            max_operand = rest[0] if rest else 20
        except ValueError:
            raise ConfigError(
                f"data.path: expected 'arithmetic:N' or 'arithmetic:N:MAX_OPERAND', got {path!r}"
            ) from None
        return make_arithmetic_prompts(n, seed=1234, max_operand=max_operand)
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"data.path: {p} does not exist ({FORMATS})")
    try:
        if p.is_dir():
            return _load_datasets_dir(p)
        suffix = p.suffix.lower()
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(p).to_pylist()
        if suffix == ".csv":
            with p.open(newline="", encoding="utf-8") as fh:
                return [dict(r) for r in csv.DictReader(fh)]
        return _load_json(p)
    except ConfigError:
        raise
    except ImportError as e:
        raise ConfigError(
            f"data.path: {p} needs a package that is not installed ({e}); pip install datasets"
        ) from None
    except Exception as e:  # OSError, UnicodeDecodeError, csv.Error, pyarrow's ArrowInvalid
        raise ConfigError(
            f"data.path: cannot read {p}: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}"
        ) from None


def _load_json(p: Path) -> list[dict[str, Any]]:
    """JSON lines (one object per line), or for a .json file also one array of objects."""
    if p.suffix.lower() == ".json":
        text = p.read_text(encoding="utf-8")
        if text.lstrip().startswith("["):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"data.path: {p}: invalid JSON ({e})") from None
            bad = next((i for i, r in enumerate(data) if not isinstance(r, dict)), None)
            if bad is not None:
                raise ConfigError(f"data.path: {p}: item {bad} of the array is not an object")
            return data
    records = []
    with p.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"data.path: {p}:{lineno}: invalid JSON ({e})") from None
            if not isinstance(rec, dict):
                raise ConfigError(f"data.path: {p}:{lineno}: each line must be a JSON object")
            records.append(rec)
    return records


def _load_datasets_dir(p: Path) -> list[dict[str, Any]]:
    """A Dataset, or the ``train`` split (or only split) of a DatasetDict, saved to disk."""
    try:
        from datasets import DatasetDict, load_from_disk
    except ImportError:
        raise ConfigError(
            f"data.path: {p} is a directory but the `datasets` package is "
            f"not installed (pip install datasets)"
        ) from None
    try:
        ds = load_from_disk(str(p))
    except FileNotFoundError:
        raise ConfigError(
            f"data.path: {p} is a directory but not a `datasets` dir saved with "
            f"save_to_disk ({FORMATS})"
        ) from None
    if isinstance(ds, DatasetDict):
        splits = list(ds)
        if "train" in ds:
            ds = ds["train"]
        elif len(splits) == 1:
            ds = ds[splits[0]]
        else:
            raise ConfigError(
                f"data.path: {p} holds the splits {splits} and none is 'train'; "
                f"save the split to train on alone"
            )
    return [dict(r) for r in ds]


def is_conversation(prompt: Any) -> bool:
    """A prompt given as a list of messages (TRL's conversational format)."""
    return isinstance(prompt, list)


def _prompt_problem(prompt: Any) -> str | None:
    """Why a prompt value is unusable (None: it is fine)."""
    if isinstance(prompt, str):
        return None
    if not isinstance(prompt, list) or not prompt:
        return f"is a {type(prompt).__name__}, expected a string or a non-empty list of messages"
    for m in prompt:
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            return f"has a message {m!r}; each must be {{'role': str, 'content': str}}"
    return None


def check_records(cfg: DataConfig, records: list[dict[str, Any]]) -> bool:
    """Every record has a usable prompt (and the answer field, when one is named); True when
    the prompts are conversational. ConfigError names the option and the first bad record."""
    if not records:
        raise ConfigError(f"data.path: {cfg.path} holds no records")
    conversational = False
    for i, r in enumerate(records):
        if cfg.prompt_field not in r:
            raise ConfigError(
                f"data.prompt_field: record {i} has no field {cfg.prompt_field!r} "
                f"(its fields: {', '.join(map(str, r)) or 'none'})"
            )
        problem = _prompt_problem(r[cfg.prompt_field])
        if problem:
            raise ConfigError(f"data.prompt_field: record {i}: {cfg.prompt_field!r} {problem}")
        conversational |= is_conversation(r[cfg.prompt_field])
        if cfg.answer_field is not None and cfg.answer_field not in r:
            raise ConfigError(
                f"data.answer_field: record {i} has no field {cfg.answer_field!r} "
                f"(its fields: {', '.join(map(str, r))})"
            )
    if conversational and cfg.chat_template == "none":
        raise ConfigError(
            "data.chat_template: the prompts are conversational (lists of "
            "messages), which only a chat template can render; use auto"
        )
    return conversational


def check_data(cfg: DataConfig, model_path: str) -> None:
    """Launcher pre-flight: the records load and check, and conversational prompts have a
    chat template to render them (the tokenizer is loaded only then)."""
    if check_records(cfg, load_records(cfg.path)):
        from transformers import AutoTokenizer

        if not getattr(AutoTokenizer.from_pretrained(model_path), "chat_template", None):
            raise ConfigError(
                f"data.chat_template: the prompts are conversational but the "
                f"tokenizer of {model_path} has no chat template"
            )


class PromptSource:
    """An endless, resumable iterator over positions of the run's prompt sequence.

    Position g is record ``order(g // N)[g % N]`` of the N records: each epoch one seeded
    permutation of all of them (``data.seed`` < 0: file order), the same in every process.
    Which positions this producer reads: ``index::num_producers`` of each epoch (a fixed
    split, for a standalone source), or, once ``lease`` is called, the ranges the learner
    leased to it (``pipeline.learner.roster``), in lease order. ``cursor`` counts the positions
    read over the leases since the run began, so it survives any re-split and restart: the
    leases are only ever appended to, and a prefix the learner knows read is dropped into
    ``base``."""

    def __init__(
        self,
        cfg: DataConfig,
        index: int = 0,
        num_producers: int = 1,
        start_cursor: int = 0,
        records: list[dict[str, Any]] | None = None,
    ):
        self.cfg = cfg
        self.records = records if records is not None else load_records(cfg.path)
        check_records(cfg, self.records)
        if len(self.records) <= index or num_producers < 1:
            raise ConfigError(f"data.path: {len(self.records)} records are fewer than the "
                              f"{num_producers} producers")
        self.index, self.num_producers = index, num_producers
        self.cursor = start_cursor
        self.leased: tuple[int, list[tuple[int, int]]] | None = None  # (base, ranges)
        self._epoch_order: tuple[int, list[int]] = (-1, [])

    def lease(self, base: int, ranges: list[tuple[int, int]]) -> None:
        """Read the learner's leases from now on: ``ranges`` [start, end) in order, the first
        ``base`` positions of this producer's leases already read and dropped. A cursor below
        ``base`` (a restarted producer that has not heard of its resent groups yet) moves up to
        it: the learner has those positions' groups."""
        self.leased = (base, [(int(a), int(b)) for a, b in ranges])
        self.cursor = max(self.cursor, base)

    def lease_from(self, flat: list[int]) -> None:
        """``lease`` from an ``Announce.leases`` entry: [base, start, end, start, end, ...]."""
        self.lease(flat[0] if flat else 0,
                   [(flat[i], flat[i + 1]) for i in range(1, len(flat) - 1, 2)])

    def position(self, cursor: int) -> int | None:
        """The sequence position read at ``cursor``; None when no lease reaches that far."""
        if self.leased is None:
            n = len(self.records)
            per_epoch = len(range(self.index, n, self.num_producers))
            epoch, k = divmod(cursor, per_epoch)
            return epoch * n + self.index + k * self.num_producers
        base, ranges = self.leased
        k = cursor - base
        for a, b in ranges:
            if k < b - a:
                return a + k
            k -= b - a
        return None

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_order[0] != epoch:
            order = list(range(len(self.records)))
            if self.cfg.seed >= 0:
                random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def record_index(self, position: int) -> int:
        """Index (file order) of the record at sequence ``position``."""
        epoch, k = divmod(position, len(self.records))
        return self._order(epoch)[k]

    def has_next(self) -> bool:
        """Whether ``take`` would return a prompt now (nothing is read)."""
        return self.position(self.cursor) is not None

    def take(self) -> PromptRecord | None:
        """The next prompt, or None while the leases are used up (the learner grants more)."""
        g = self.position(self.cursor)
        if g is None:
            return None
        i = self.record_index(g)
        rec = self.records[i]
        self.cursor += 1
        cfg = self.cfg
        meta = {k: v for k, v in rec.items() if k != cfg.prompt_field}
        if cfg.answer_field is not None:
            meta["answer"] = rec[cfg.answer_field]
        pid = str(rec.get(cfg.id_field, i))
        return PromptRecord(prompt_id=pid, prompt=rec[cfg.prompt_field], meta=meta,
                            cursor=self.cursor, position=g)

    def __iter__(self) -> Iterator[PromptRecord]:
        return self

    def __next__(self) -> PromptRecord:
        rec = self.take()
        if rec is None:
            raise StopIteration
        return rec


def render_prompt(tokenizer: Any, cfg: DataConfig, prompt: str | list[dict[str, Any]]) -> list[int]:
    """Token ids of a prompt: a conversation through the chat template (``system_prompt``
    first unless it has a system message); a string through it too with ``chat_template:
    auto`` and a tokenizer that has one (as one user message), else tokenized as it is."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if is_conversation(prompt):
        if cfg.chat_template == "none" or not has_template:
            raise ConfigError(
                "data.chat_template: conversational prompts need the tokenizer's "
                "chat template (chat_template: auto, and a model that has one)"
            )
        messages = list(prompt)
    elif cfg.chat_template == "auto" and has_template:
        messages = [{"role": "user", "content": prompt}]
    else:
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if cfg.system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": cfg.system_prompt})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
