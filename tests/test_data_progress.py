"""Progress of long data work (tasks/data/progress.py): off a terminal, log lines with the rate and the ETA of
tokenizer training, tokenization and packing (here every update: LLAMAFLOW_PROGRESS_SECONDS=0) and no bar;
on a terminal, a tqdm bar and no log lines. The mapped tokenization's lines in a flow: tests/test_data_dask.py."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest

from stdlib_corpus import MODULES, copy_modules
from tasks.data.progress import Progress
from tasks.dataset import build_dataset
from tasks.tokenize import train_tokenizer


def test_data_work_off_a_terminal_logs_rate_and_eta_and_draws_no_bar(
    home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("LLAMAFLOW_PROGRESS_SECONDS", "0")
    corpus = tmp_path / "corpus"
    copy_modules(corpus, MODULES[:8])
    with caplog.at_level(logging.INFO, logger="llamaflow.data"):
        tokenizer = train_tokenizer(str(corpus), 300)
        build_dataset(str(corpus), tokenizer, 32)
    lines = [r.getMessage() for r in caplog.records if r.name == "llamaflow.data"]

    def last(prefix: str) -> str:
        found = [line for line in lines if line.startswith(prefix)]
        assert found, (prefix, lines)
        return found[-1]

    reading = last("tokenizer training: reading text:")
    assert "(100%)" in reading and "B/s, ETA 00:00" in reading, reading
    tokenizing = last("tokenizing:")
    assert "(100%)" in tokenizing and "B/s, ETA 00:00" in tokenizing, tokenizing
    packing = last("packing train.npy:")
    assert "(100%)" in packing and "tokens/s, ETA" in packing, packing
    assert "%|" not in capsys.readouterr().err  # no bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_with_rate_and_eta_instead_of_log_lines(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLAMAFLOW_PROGRESS_SECONDS", "0")
    terminal = _Terminal()
    with (
        caplog.at_level(logging.INFO, logger="llamaflow.data"),
        Progress("tokenizing", 4096, stream=terminal) as p,
    ):
        for _ in range(4):
            p.update(1024)
    assert "tokenizing: 100%|" in terminal.getvalue() and "B/s]" in terminal.getvalue(), terminal.getvalue()
    assert not [r for r in caplog.records if r.name == "llamaflow.data"]
