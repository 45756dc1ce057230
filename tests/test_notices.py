"""Notices of a slow first call: a compiled step says which shape compiles, once per shape; the
Triton interpreter on the CPU is named once; without a logging setup they reach stderr, above a
progress bar on a terminal."""

import io
import logging
import sys

import pytest
import torch
from tiny_models import tiny_llama

from specdec_fast import notices
from specdec_fast.compiled import CompiledSteps
from specdec_fast.progress import Progress
from specdec_fast.runner import ModelRunner


@pytest.fixture
def eager_dynamo(monkeypatch):
    """Steps compile with dynamo's eager backend: the same compile callbacks, no C++ (< 1 s)."""
    compile_ = torch.compile

    def eager(fn, **options):
        return compile_(fn, **{**options, "backend": "eager"})

    monkeypatch.setattr(torch, "compile", eager)


def told(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == notices.LOGGER.name]


def test_a_compiling_step_says_so_once_per_shape(eager_dynamo, caplog):
    caplog.set_level(logging.INFO, logger=notices.LOGGER.name)
    steps = CompiledSteps("toy", compile=True)

    def verify(tokens):
        return tokens * 2 + 1

    steps.run("verify", "verify B=2 N=3", verify, torch.ones(2, 3))
    assert len(told(caplog)) == 1
    assert told(caplog)[0].startswith("compiling toy verify B=2 N=3: the first call of this step")
    # The same shape, then another of its dynamic class, reuse the graph: nothing more is told.
    steps.run("verify", "verify B=2 N=3", verify, torch.ones(2, 3))
    steps.run("verify", "verify B=3 N=5", verify, torch.ones(3, 5))
    assert len(told(caplog)) == 1
    # A new graph (batch 1 compiles apart) is told with its own label.
    steps.run("verify", "verify B=1 N=3", verify, torch.ones(1, 3))
    assert told(caplog)[1].startswith("compiling toy verify B=1 N=3")


def test_compilations_outside_the_steps_are_not_told(eager_dynamo, caplog):
    caplog.set_level(logging.INFO, logger=notices.LOGGER.name)
    steps = CompiledSteps("toy", compile=True)
    steps.run("decode", "decode B=1", lambda x: x + 5, torch.ones(1, 2))  # registers the callback
    assert len(told(caplog)) == 1
    torch.compile(lambda x: x - 3)(torch.ones(4))
    assert len(told(caplog)) == 1


def test_steps_are_told_after_dynamo_resets(eager_dynamo, caplog):
    """`torch._dynamo.reset()` (torch.compiler.reset(), inductor's run_and_get_code) clears
    dynamo's callbacks: the next step that compiles registers the notice again."""
    caplog.set_level(logging.INFO, logger=notices.LOGGER.name)
    steps = CompiledSteps("toy", compile=True)
    steps.run("decode", "decode B=1", lambda x: x * 3, torch.ones(1, 2))
    torch._dynamo.reset()
    CompiledSteps("toy", compile=True).run("decode", "decode B=2", lambda x: x * 4, torch.ones(2))
    assert [message.split(":")[0] for message in told(caplog)] == [
        "compiling toy decode B=1",
        "compiling toy decode B=2",
    ]


def test_the_interpreter_on_the_cpu_is_named_once(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=notices.LOGGER.name)
    monkeypatch.setattr(notices, "_GIVEN", set())
    model = tiny_llama()
    monkeypatch.setenv("SPECDEC_BACKEND", "fused")
    ModelRunner(model, 16, compile=False).close()
    assert told(caplog) == []
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    for _ in range(2):
        ModelRunner(model, 16, compile=False).close()
    assert len(told(caplog)) == 1
    assert told(caplog)[0].startswith("SPECDEC_BACKEND=triton on the CPU: the Triton kernels run")


def test_without_a_logging_setup_a_notice_is_a_line_on_stderr(monkeypatch, capsys):
    monkeypatch.setattr(notices.LOGGER, "hasHandlers", lambda: False)
    notices.notice("compiling toy verify B=1 N=3")
    assert capsys.readouterr().err == "specdec-fast: compiling toy verify B=1 N=3\n"


def test_on_a_terminal_a_notice_is_a_line_of_its_own_above_the_progress_bar(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(notices.LOGGER, "hasHandlers", lambda: False)
    with Progress(4, desc="generate", min_interval_s=0.0) as progress:
        progress.update(1)
        notices.notice("compiling toy verify B=1 N=3")
        progress.update(1)
    text = terminal.getvalue()
    before, _, after = text.partition("specdec-fast: compiling toy verify B=1 N=3\n")
    assert before.endswith("\r")  # the bar's line was cleared first
    assert "generate" in after  # and the bar drawn again below the notice
