"""bench.writer_gil runs end to end on a small state and prints its table."""

from __future__ import annotations

import sys

import pytest

from bench import writer_gil


def test_prints_a_row_per_writer_and_cleans_up(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["writer_gil", "--gb", "0.001", "--dir", str(tmp_path)])
    writer_gil.main()
    rows = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| ")]
    assert len(rows) == 1 + 1 + 4  # header, the spinner alone, two writers twice
    assert (tmp_path / "ours" / "trainer.json").is_file()  # the learner's own writer wrote it


def test_the_spinner_stops_when_the_work_raises():
    def fail() -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):  # and does not hang on the spinner
        writer_gil.spin_beside(fail)
