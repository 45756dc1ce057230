"""Progress on stderr: one self-rewriting line on a terminal, nothing in a pipe or a log file
(plain status lines only where asked, as training asks)."""

import io
import sys

from specdec_fast.progress import Progress
from specdec_fast.train.progress import LOG_EVERY_S


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run(progress: Progress) -> None:
    for loss in ("1.000", "0.750", "0.500", "0.250"):
        progress.update(1, loss=loss)
    progress.close()


def test_a_terminal_gets_a_single_self_rewriting_line(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    run(Progress(4, desc="generate", unit="tok", min_interval_s=0.0))
    text = terminal.getvalue()
    assert "generate" in text and "4/4" in text and "loss=0.250" in text
    assert "\n" not in text  # updates rewrite the line with carriage returns
    assert text.count("\r") >= 4


def test_a_pipe_gets_nothing(capsys):
    run(Progress(4, desc="generate", min_interval_s=0.0))
    assert capsys.readouterr().err == ""


def test_disabled_shows_nothing_even_on_a_terminal(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    run(Progress(4, desc="generate", min_interval_s=0.0, log_every_s=0.0, enabled=False))
    assert terminal.getvalue() == ""


def test_a_log_file_gets_plain_lines_when_asked(capsys):
    run(Progress(4, desc="train", log_every_s=0.0))
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 4 and "\r" not in "".join(lines)
    assert lines[-1].startswith("train 4/4 loss=0.250")
    # Training asks for one such line every few seconds (and always the last one).
    run(Progress(4, desc="train", log_every_s=LOG_EVERY_S))
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("train 4/4 loss=0.250") and len(lines) <= 2


def test_a_terminal_is_told_while_a_graph_compiles(monkeypatch):
    import torch
    from torch._dynamo.callback import callback_handler

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    registered = len(callback_handler.start_callbacks), len(callback_handler.end_callbacks)
    step = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    with Progress(4, desc="generate", min_interval_s=0.0, compiles=True) as progress:
        step(torch.ones(3))
        progress.update(1)
    text = terminal.getvalue()
    assert "generate (compiling a step graph)" in text
    assert text.rindex("(compiling") < text.rindex("generate:")  # said until it ended
    assert (
        len(callback_handler.start_callbacks),
        len(callback_handler.end_callbacks),
    ) == registered
