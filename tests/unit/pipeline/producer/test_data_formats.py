"""Datasets the way users have them: JSONL, JSON arrays, Parquet, CSV and `datasets` dirs, field
mapping, conversational prompts through the chat template, and one-line errors (exit 2).

Real files written with pyarrow/csv/datasets, the real tiny model's tokenizer, and the real
``pipeline-train`` CLI for the exit codes.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import DataConfig, load_config
from pipeline.options import ConfigError
from pipeline.producer.data import (
    PromptSource,
    check_data,
    check_records,
    load_records,
    render_prompt,
)

REPO = Path(__file__).resolve().parents[4]

ROWS = [
    {"question": "What is 2+2?", "solution": "4", "task": "math", "level": 1},
    {"question": "What is 3*4?", "solution": "12", "task": "math", "level": 2},
    {"question": "Write add(a, b).", "solution": "def add", "task": "code", "level": 3},
]
CHAT_ROWS = [
    {
        "prompt": [
            {"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": "What is 2+2?"},
        ],
        "answer": "4",
    },
    {"prompt": [{"role": "user", "content": "What is 3*4?"}], "answer": "12"},
]


def write(tmp_path: Path, fmt: str, rows: list[dict]) -> Path:
    if fmt == "jsonl":
        p = tmp_path / "d.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        p = tmp_path / "d.json"
        p.write_text(json.dumps(rows))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        p = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist(rows), p)
    elif fmt == "csv":
        p = tmp_path / "d.csv"
        with p.open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    elif fmt == "datasets":
        datasets = pytest.importorskip("datasets")
        p = tmp_path / "ds"
        datasets.Dataset.from_list(rows).save_to_disk(str(p))
    elif fmt == "datasetdict":
        datasets = pytest.importorskip("datasets")
        p = tmp_path / "dsd"
        datasets.DatasetDict(
            {
                "train": datasets.Dataset.from_list(rows),
                "test": datasets.Dataset.from_list(rows[:1]),
            }
        ).save_to_disk(str(p))
    else:
        raise AssertionError(fmt)
    return p


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from pipeline.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "datasets", "datasetdict"])
def test_every_format_with_field_mapping(tmp_path, fmt):
    p = write(tmp_path, fmt, ROWS)
    cfg = DataConfig(path=str(p), prompt_field="question", answer_field="solution", seed=-1)
    recs = [next(src) for src in [PromptSource(cfg, 0, 1)] for _ in range(3)]
    assert [r.prompt for r in recs] == [r["question"] for r in ROWS]
    # The answer field reaches rewards as `answer`; every other column rides along.
    assert [r.meta["answer"] for r in recs] == ["4", "12", "def add"]
    assert [r.meta["task"] for r in recs] == ["math", "math", "code"]
    assert [r.meta["solution"] for r in recs] == ["4", "12", "def add"]
    level = [r.meta["level"] for r in recs]
    assert level == (["1", "2", "3"] if fmt == "csv" else [1, 2, 3])  # CSV cells are text
    assert "question" not in recs[0].meta


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "datasets"])
def test_conversational_prompts_survive_each_format(tmp_path, fmt):
    p = write(tmp_path, fmt, CHAT_ROWS)
    cfg = DataConfig(path=str(p), seed=-1)
    assert check_records(cfg, load_records(str(p))) is True
    rec = next(PromptSource(cfg, 0, 1))
    assert rec.prompt == CHAT_ROWS[0]["prompt"] and rec.meta["answer"] == "4"


def test_render_conversation_with_chat_template(tokenizer):
    cfg = DataConfig()
    ids = render_prompt(tokenizer, cfg, CHAT_ROWS[0]["prompt"])
    text = tokenizer.decode(ids)
    assert text == (
        "<|im_start|>system\nAnswer with a number.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    # system_prompt goes first only where the conversation has no system message of its own.
    cfg = DataConfig(system_prompt="Be brief.")
    assert render_prompt(tokenizer, cfg, CHAT_ROWS[0]["prompt"]) == ids
    text = tokenizer.decode(render_prompt(tokenizer, cfg, CHAT_ROWS[1]["prompt"]))
    assert text.startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 3*4?"
    )


def test_render_plain_prompt_auto_and_none(tokenizer):
    auto = tokenizer.decode(render_prompt(tokenizer, DataConfig(), "2+2?"))
    assert auto == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    none = tokenizer.decode(render_prompt(tokenizer, DataConfig(chat_template="none"), "2+2?"))
    assert none == "2+2?"


def test_chat_template_option_values():
    assert DataConfig(chat_template=True).chat_template == "auto"
    assert DataConfig(chat_template="false").chat_template == "none"
    with pytest.raises(ConfigError, match=r"data\.chat_template"):
        DataConfig(chat_template="always")
    cfg = load_config(None, {"data.chat_template": "none", "data.prompt_field": "q"})
    assert (cfg.data.chat_template, cfg.data.prompt_field) == ("none", "q")


def test_conversational_needs_a_chat_template(tmp_path, tokenizer):
    p = write(tmp_path, "jsonl", CHAT_ROWS)
    with pytest.raises(ConfigError, match=r"data\.chat_template: the prompts are conversational"):
        check_records(DataConfig(path=str(p), chat_template="none"), load_records(str(p)))
    tokenizer_dir = tmp_path / "tok"
    tokenizer.save_pretrained(tokenizer_dir)
    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    for extra in tokenizer_dir.glob("chat_template.*"):
        extra.unlink()
    with pytest.raises(ConfigError, match="has no chat template"):
        check_data(DataConfig(path=str(p)), str(tokenizer_dir))


@pytest.mark.parametrize(
    "rows, cfg_kw, match",
    [
        (
            [{"text": "a"}],
            {},
            r"data.prompt_field: record 0 has no field 'prompt' \(its fields: text\)",
        ),
        ([{"prompt": "a"}, {"prompt": 3}], {}, r"record 1: 'prompt' is a int"),
        ([{"prompt": [{"role": "user"}]}], {}, r"each must be \{'role': str, 'content': str\}"),
        ([{"prompt": []}], {}, r"non-empty list of messages"),
        ([{"prompt": "a"}], {"answer_field": "solution"}, r"data.answer_field: record 0"),
    ],
)
def test_bad_records_name_the_option(tmp_path, rows, cfg_kw, match):
    p = write(tmp_path, "jsonl", rows)
    with pytest.raises(ConfigError, match=match):
        PromptSource(DataConfig(path=str(p), **cfg_kw), 0, 1)


def test_unreadable_and_empty_sources(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match=rf"data.path: cannot read {bad}: "):
        load_records(str(bad))
    latin = tmp_path / "latin.csv"
    latin.write_bytes(b"prompt\n\xff\xfe caf\xe9\n")
    with pytest.raises(ConfigError, match="UnicodeDecodeError"):
        load_records(str(latin))
    empty = tmp_path / "empty.csv"
    empty.write_text("prompt,answer\n")
    with pytest.raises(ConfigError, match="holds no records"):
        check_records(DataConfig(path=str(empty)), load_records(str(empty)))
    not_ds = tmp_path / "plain_dir"
    not_ds.mkdir()
    with pytest.raises(ConfigError, match="not a `datasets` dir"):
        load_records(str(not_ds))
    arr = tmp_path / "arr.json"
    arr.write_text('[{"prompt": "a"}, 3]')
    with pytest.raises(ConfigError, match="item 1 of the array is not an object"):
        load_records(str(arr))


def test_datasetdict_without_train_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    p = tmp_path / "dsd"
    datasets.DatasetDict(
        {"a": datasets.Dataset.from_list(ROWS), "b": datasets.Dataset.from_list(ROWS)}
    ).save_to_disk(str(p))
    with pytest.raises(ConfigError, match=r"splits \['a', 'b'\] and none is 'train'"):
        load_records(str(p))


@pytest.mark.parametrize(
    "rows, flags, match",
    [
        ([{"text": "a"}], [], "data.prompt_field: record 0 has no field 'prompt'"),
        ([], [], "holds no records"),
        (CHAT_ROWS, ["--data.chat_template", "none"], "data.chat_template: the prompts are"),
    ],
)
def test_cli_exits_2_with_one_line(tmp_path, tiny_dir, rows, flags, match):
    """The launcher's pre-flight refuses bad data before any process starts."""
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.launch.cli",
            "--model",
            str(tiny_dir),
            "--data",
            str(p),
            "--run-dir",
            str(tmp_path / "run"),
            *flags,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and match in lines[0] and "Traceback" not in proc.stderr, lines
