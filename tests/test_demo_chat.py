"""The chat demo's contenders and table (the real target's run: tests/test_chat_target.py)."""

from specdec_fast.demo_chat import Contender, report


def fixed(tokens: list[int], steps: int | None, name: str = "x"):
    return Contender(name, lambda ids: (tokens, steps))


def test_a_round_records_outputs_rate_and_steps():
    contender = fixed([5, 6, 7, 8], 2)
    contender.run_round([[1], [2]])
    contender.run_round([[1], [2]])
    assert contender.outputs == [[5, 6, 7, 8], [5, 6, 7, 8]]
    assert contender.tokens_per_step == 8 / 4  # 8 tokens over 2 steps per prompt
    assert len(contender.rates) == 2 and contender.median_rate > 0
    assert fixed([5], None).tokens_per_step is None


def test_the_table_fails_on_a_different_output(capsys):
    hf, plain = fixed([5, 6], None, "HF generate"), fixed([5, 6], 2, "plain")
    same, other = fixed([5, 6], 1, "same"), fixed([5], 1, "other")
    for contender in (hf, plain, same, other):
        contender.run_round([[1]])
    assert report([hf, plain, same]) == 0
    assert "identical to HF generate: yes, for every drafter" in capsys.readouterr().out
    assert report([hf, plain, same, other]) == 1
    table = capsys.readouterr().out
    assert [line.split()[-1] for line in table.splitlines()[3:7]] == ["ref", "yes", "yes", "NO"]
