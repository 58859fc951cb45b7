"""Prompt sources for producers: JSONL, a `datasets` dir on disk, or synthetic arithmetic.

Each producer reads its own shard (records i with i % num_producers == index) in a fixed,
seeded order, so the position in the shard (the cursor) is all that is needed to resume; the
learner records the highest cursor it received per producer and checkpoints it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import ConfigError, DataConfig


@dataclass
class PromptRecord:
    prompt_id: str
    prompt: str
    meta: dict[str, Any]   # every other field of the record (e.g. "answer"), for rewards
    cursor: int            # position in this producer's shard, + 1 (resume point)


def load_records(path: str) -> list[dict[str, Any]]:
    """All records of a source, in file order. Raises ConfigError with the path on failure."""
    if path.startswith("arithmetic:"):
        from pipeline.tasks.arithmetic import make_arithmetic_prompts
        try:
            n, *rest = (int(x) for x in path.split(":")[1:])
            max_operand = rest[0] if rest else 20
        except ValueError:
            raise ConfigError(f"data.path: expected 'arithmetic:N' or 'arithmetic:N:MAX_OPERAND',"
                              f" got {path!r}") from None
        return make_arithmetic_prompts(n, seed=1234, max_operand=max_operand)
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"data.path: {p} does not exist (a JSONL file, a datasets dir saved "
                          f"with save_to_disk, or 'arithmetic:N[:MAX_OPERAND]')")
    if p.is_dir():
        try:
            from datasets import load_from_disk
        except ImportError:
            raise ConfigError(f"data.path: {p} is a directory but the `datasets` package is "
                              f"not installed (pip install datasets)") from None
        ds = load_from_disk(str(p))
        return [dict(r) for r in ds]
    records = []
    with p.open() as fh:
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


class PromptSource:
    """An endless, resumable iterator over one producer's shard (epochs reshuffle)."""

    def __init__(self, cfg: DataConfig, index: int, num_producers: int, start_cursor: int = 0,
                 records: list[dict[str, Any]] | None = None):
        self.cfg = cfg
        recs = records if records is not None else load_records(cfg.path)
        if not recs:
            raise ConfigError(f"data.path: {cfg.path} holds no records")
        missing = [i for i, r in enumerate(recs[:100]) if cfg.prompt_key not in r]
        if missing:
            raise ConfigError(f"data.prompt_key: record {missing[0]} has no field "
                              f"{cfg.prompt_key!r}")
        self.shard = [(i, r) for i, r in enumerate(recs) if i % num_producers == index]
        if not self.shard:
            raise ConfigError(f"data.path: {len(recs)} records are fewer than the "
                              f"{num_producers} producers")
        self.cursor = start_cursor
        self._epoch_order: tuple[int, list[int]] = (-1, [])

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_order[0] != epoch:
            order = list(range(len(self.shard)))
            if self.cfg.seed >= 0:
                random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def __iter__(self) -> Iterator[PromptRecord]:
        return self

    def __next__(self) -> PromptRecord:
        epoch, pos = divmod(self.cursor, len(self.shard))
        i, rec = self.shard[self._order(epoch)[pos]]
        self.cursor += 1
        meta = {k: v for k, v in rec.items() if k != self.cfg.prompt_key}
        pid = str(rec.get(self.cfg.id_key, i))
        return PromptRecord(prompt_id=pid, prompt=str(rec[self.cfg.prompt_key]), meta=meta,
                            cursor=self.cursor)


def render_prompt(tokenizer: Any, cfg: DataConfig, text: str) -> list[int]:
    """Token ids of a prompt, through the chat template when configured."""
    if cfg.chat_template and getattr(tokenizer, "chat_template", None):
        messages = []
        if cfg.system_prompt:
            messages.append({"role": "system", "content": cfg.system_prompt})
        messages.append({"role": "user", "content": text})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])
