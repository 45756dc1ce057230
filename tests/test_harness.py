"""The benchmark harness: prompt files, quality checks, the sweep and its report, the CLI, and
the whole `specdec-fast bench` on the bundled models."""

import json
import sys
from pathlib import Path

import pytest
import torch
from test_cli import CHAT_TEMPLATE, tiny_tokenizer
from tiny_models import tiny_llama

from specdec_fast import NGramDrafter, bundled
from specdec_fast.cli import main
from specdec_fast.drafters.registry import DrafterSpec
from specdec_fast.guardrails import GuardrailPolicy, Guardrails
from specdec_fast.harness import PromptRecord, default_prompts, load_prompts, run_sweep
from specdec_fast.harness.checks import passes, validate_check
from specdec_fast.harness.plan import (
    CPU_COMPILE_S_PER_SHAPE,
    CPU_COMPILED_SPEEDUP,
    Eta,
    choose_compile,
)
from specdec_fast.harness.prompts import TASKS
from specdec_fast.harness.report import best_by_task, quality_section, write_report
from specdec_fast.harness.sweep import (
    BenchConfig,
    CellRun,
    Encoded,
    encode_prompts,
    guardrail_verdict,
    logit_gap,
    quality,
)
from specdec_fast.stats import SpecStats

VOCAB = 96


class CharTokenizer:
    """Characters to ids modulo the tiny models' vocabulary (decoding is lossy, which is fine)."""

    bos_token_id = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % VOCAB for c in text]

    def decode(self, tokens, skip_special_tokens=False, clean_up_tokenization_spaces=None):
        return "".join(chr(32 + t) for t in tokens)


def test_prompt_rows_may_give_chat_messages(tmp_path):
    path = tmp_path / "chat.jsonl"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    path.write_text(json.dumps({"messages": messages, "task": "qa"}) + "\n")
    (record,) = load_prompts(path)
    assert record.prompt is None and record.messages == messages
    assert record.text == "system: Be brief.\nuser: Hi"
    assert record.to_dict() == {"messages": messages, "task": "qa", "temperature": 0.0,
                                "id": "chat.jsonl:1"}  # fmt: skip
    for line, message in [
        ({"prompt": "a", "messages": messages}, r"chat\.jsonl:1: give `prompt` or `messages`"),
        ({"messages": []}, r"chat\.jsonl:1\.messages: expected a non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, r"messages\[0\]\.role: expected one"),
        ({"messages": [{"role": "user"}]}, r"messages\[0\]: expected an object with `role`"),
    ]:
        path.write_text(json.dumps(line) + "\n")
        with pytest.raises(ValueError, match=message):
            load_prompts(path)


def test_prompts_are_encoded_with_the_chat_template_when_there_is_one():
    tokenizer = tiny_tokenizer()
    records = [
        PromptRecord("def f():", id="text"),
        PromptRecord(None, id="chat", messages=[{"role": "user", "content": "def f():"}]),
    ]
    raw = encode_prompts(records[:1], tokenizer, 8, chat=None)[0].ids  # no template yet
    assert raw == tokenizer.encode("def f():", add_special_tokens=False)
    with pytest.raises(ValueError, match="prompt 'chat': messages: the prompt needs a chat"):
        encode_prompts(records, tokenizer, 8)
    tokenizer.chat_template = CHAT_TEMPLATE
    text, chat = encode_prompts(records, tokenizer, 8)
    expected = tokenizer.encode("<|user|>def f():<eos><|assistant|>", add_special_tokens=False)
    assert text.ids == chat.ids == expected  # a text prompt is one user message
    assert encode_prompts(records[:1], tokenizer, 8, chat=False)[0].ids == raw
    # A prompt beyond the model's positions is refused before anything runs, wherever it is.
    limit = len(raw) - 1
    with pytest.raises(ValueError, match=f"prompt 'text': {len(raw)} tokens, more than the "):
        encode_prompts(records[:1], tokenizer, 8, chat=False, max_positions=limit)


def test_load_prompts_validates_each_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "a", "task": "qa", "max_new_tokens": 5, "temperature": 0.5, "check": "json"}\n'
        "\n"
        '{"prompt": "b"}\n'
    )
    records = load_prompts(path)
    assert [r.prompt for r in records] == ["a", "b"]
    assert records[0].max_new_tokens == 5 and records[0].check == "json"
    assert records[1].task == "other" and records[1].temperature == 0.0
    for line, message in [
        ("{bad json", r"p\.jsonl:1: invalid JSON"),
        ('{"task": "qa"}', r"p\.jsonl:1\.prompt: expected a non-empty string \(or chat"),
        ('{"prompt": "a", "check": "(unclosed"}', r"p\.jsonl:1\.check: expected one of"),
        ('{"prompt": "a", "max_new_tokens": 0}', r"max_new_tokens: expected a positive integer"),
        ('{"prompt": "a", "temperature": -1}', r"temperature: expected 0 or a finite number"),
        ('{"prompt": "a", "colour": 1}', r"unknown fields \['colour'\]"),
    ]:
        path.write_text(line + "\n")
        with pytest.raises(ValueError, match=message):
            load_prompts(path)


def test_default_prompt_set_spans_every_task_type():
    records = default_prompts()
    assert {r.task for r in records} == set(TASKS)
    for record in records:
        if record.check is not None:
            validate_check(record.check)
    assert any(r.temperature > 0 for r in records)  # the temperature split has two sides
    assert len(default_prompts(1)) == len(TASKS)


@pytest.mark.parametrize(
    ("check", "text", "expected"),
    [
        ("json", 'here: {"a": [1, 2]} and more', True),
        ("json", '{"a": [1, 2', False),
        ("json", "no json", False),
        ("python", "    x = 1\n    if x:\n", True),  # an open block gets a body
        ("python", "x = (1,\n", False),
        ("python", "x = 1\ny = 2 + ", True),  # the last partial line is not judged
        ("python", "Here:\n```python\ndef f(x):\n    return x + 1\n```\nDone.", True),
        ("python", "Here:\n```python\ndef f(x):\n    return x +\n```\n", False),
        ("python", "Sure:\n```\nfor i in range(3):\n    print(i)\n    if i", True),  # cut short
        (r"(?i)\bselect\b", "SELECT a FROM t", True),
        (r"^\w+ =", "  key = 1", False),
    ],
)
def test_checks(check, text, expected):
    assert passes(check, text) is expected


def test_an_empty_regular_expression_is_refused():
    with pytest.raises(ValueError, match="got an empty one"):
        validate_check("")


def test_exact_check_compares_with_the_baseline():
    assert passes("exact", "abc", "abc") and not passes("exact", "abd", "abc")


def run_of(outputs):
    return CellRun(SpecStats(), outputs, {}, {}, 1.0)


def test_quality_reports_every_divergence_with_its_first_position():
    prompts = [
        Encoded(PromptRecord("p0", "qa", check="json", id="a"), 0, [1], 4),
        Encoded(PromptRecord("p1", "code", id="b"), 1, [1], 4),
        Encoded(PromptRecord("p2", "qa", temperature=0.7, check="json", id="c"), 2, [1], 4),
    ]
    tokenizer = CharTokenizer()
    brace = [ord("{") - 32, ord("}") - 32]  # decodes to "{}"
    baseline = run_of({0: brace, 1: [5, 6, 7], 2: brace})
    cell = run_of({0: brace, 1: [5, 6, 8], 2: [5, 5]})
    q = quality(prompts, cell, baseline, tokenizer)
    assert q["greedy_prompts"] == 2 and q["greedy_exact_matches"] == 1
    assert q["baseline_check_passes"] == 2 and q["speculative_check_passes"] == 1
    assert q["quality_regressions"] == 1
    by_id = {d["prompt_id"]: d for d in q["divergences"]}
    assert set(by_id) == {"b", "c"}
    assert by_id["b"]["first_differing_token"] == 2 and by_id["b"]["greedy"]
    assert by_id["c"]["quality_regression"] and not by_id["c"]["greedy"]
    assert by_id["c"]["baseline_output"] == "{}" and by_id["c"]["prompt"] == "p2"
    report = {"config": {"exact": False}, "cells": [{"name": "ngram:3", "batch": 1, "quality": q}]}
    text = "\n".join(quality_section(report))
    assert "plain decoding 2 of 2, speculation 1 of 2" in text


def test_quality_tells_near_ties_from_real_divergences():
    """With the target, a divergence whose two tokens' logits are within `near_tie_gap` under
    the baseline's context is a near-tie; a wider gap, or an output that stopped, is real."""
    model = tiny_llama(vocab_size=VOCAB)
    context = [3, 4, 5]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([context])).logits[0, -1].float()
    ranked = logits.argsort(descending=True).tolist()
    top, runner_up, last = ranked[0], ranked[1], ranked[-1]
    close, far = logit_gap(model, context, top, runner_up), logit_gap(model, context, top, last)
    assert close == pytest.approx(float(logits[top] - logits[runner_up]))
    assert close < far
    prompts = [Encoded(PromptRecord(f"p{i}", "qa", id=f"p{i}"), i, context, 3) for i in range(3)]
    baseline = run_of({0: [top, 1], 1: [top, 1], 2: [top, 1]})
    cell = run_of({0: [runner_up, 1], 1: [last, 1], 2: [top]})
    gap = (close + far) / 2
    q = quality(prompts, cell, baseline, CharTokenizer(), model=model, near_tie_gap=gap)
    by_id = {d["prompt_id"]: d for d in q["divergences"]}
    assert by_id["p0"]["near_tie"] and by_id["p0"]["logit_gap"] == pytest.approx(close)
    assert not by_id["p1"]["near_tie"] and by_id["p1"]["logit_gap"] == pytest.approx(far)
    assert not by_id["p2"]["near_tie"] and by_id["p2"]["logit_gap"] is None
    assert (q["near_tie_divergences"], q["real_divergences"], q["near_tie_gap"]) == (1, 2, gap)
    report = {
        "config": {"exact": True, "near_tie_gap": gap},
        "cells": [{"name": "ngram:3", "batch": 1, "quality": q}],
    }
    text = "\n".join(quality_section(report))
    assert "Mode: exact" in text
    assert "3 divergences" in text and "1 at near-ties" in text and "2 real" in text
    assert "(near-tie)" in text


class FailingDrafter(NGramDrafter):
    def propose(self, state):
        raise RuntimeError("boom")


def test_sweep_end_to_end_on_a_tiny_model(tmp_path, monkeypatch):
    model = tiny_llama(vocab_size=VOCAB)
    records = [
        PromptRecord("abcabcabcabc", "code", 12, check="python", id="p0"),
        PromptRecord("xyzxyzxyz", "structured", 12, check="json", id="p1"),
        PromptRecord("hello hello hello", "qa", 8, temperature=0.8, check=r"\w", id="p2"),
    ]
    strict = GuardrailPolicy(min_acceptance_rate=0.99)
    config = BenchConfig(
        drafters=["ngram", "suffix:3"],
        sizes=[2],
        batches=[1, 2],
        price_per_hour=3.6,
        guardrails=Guardrails(routes={"code": strict}),
    )
    calls = []

    def make(spec, size):
        calls.append((spec.kind, size))
        return spec.build(model, size)

    with torch.no_grad():
        report = run_sweep(model, CharTokenizer(), records, config, make, progress=False)
    assert report["failed_requests"] == []
    names = [(c["name"], c["batch"]) for c in report["cells"]]
    # k = 2 drafted tokens: a tree drafter verifies N = 3 nodes, root included.
    cells = ("ngram:3", "adaptive(ngram:3)", "suffix:3", "adaptive(suffix:3)")
    assert names == [(n, b) for b in (1, 2) for n in cells]
    assert {c["nodes"] for c in report["cells"]} == {3}
    assert ("ngram", 3) in calls
    assert report["cost_model"]["verify_s"]  # calibrated for the adaptive cells
    for cell in report["cells"]:
        m = cell["metrics"]
        assert m["sequences"] == 3 and m["error_rate"] == 0.0
        assert cell["speedup"] > 0 and m["requests_per_second"] > 0
        # $3.6/h is $0.001/s: the cost of 1K tokens is the seconds per 1K tokens / 1000.
        assert m["cost_per_1k_output_tokens"] == pytest.approx(
            m["wall_time_s"] / m["new_tokens"], rel=1e-6
        )
        assert cell["quality"]["greedy_exact_matches"] == cell["quality"]["greedy_prompts"] == 2
        assert cell["quality"]["divergences"] == []
        assert set(cell["splits"]) == {"task", "output_length", "temperature", "prompt_length"}
        assert set(cell["splits"]["temperature"]) == {"greedy", "t=0.8"}
        verdicts = cell["guardrails"]
        assert set(verdicts) == {"all", "code", "structured", "qa"}
        if cell["splits"]["task"]["code"]["acceptance_rate"] is not None:
            assert not verdicts["code"]["speculate"]  # no random drafter reaches 99%
            assert "acceptance" in verdicts["code"]["broken"][0]
    adaptive = [c for c in report["cells"] if c["adaptive"]]
    assert all(c["adaptive_budgets"]["steps"] > 0 for c in adaptive)
    assert all(c["adaptive_budgets"]["explorations"] >= 0 for c in adaptive)
    for batch in ("1", "2"):
        base = report["baseline"][batch]
        assert base["tokens_per_second"] > 0 and len(base["ttft_s"]) == 3
        assert report["noise"][batch] >= config.noise_floor
    # Limits 12, 12, 8: at batch 2 the third prompt decodes alone, and the summary says so.
    assert report["formed_batches"] == {"1": [1, 1, 1], "2": [1, 2]}

    files = write_report(report, tmp_path)
    saved = json.loads((tmp_path / "report.json").read_text())
    assert len(saved["cells"]) == 2 * len(cells) and len(saved["adaptive_vs_baseline"]) == 4
    assert set(saved["best_by_task_and_batch"]) == {"code", "structured", "qa"}
    text = (tmp_path / "report.md").read_text()
    sections = [
        "## Baseline", "## Cells", "## Best configuration per task type",
        "## Where speculation loses", "## Adaptive speculation against the baseline",
        "## Quality equivalence", "### by temperature", "## Guardrail verdicts",
    ]  # fmt: skip
    assert all(section in text for section in sections)
    assert "the calls made at each concurrency below it held 2: 1, 2 prompts" in text
    # matplotlib is a test dependency: the four plots are real PNGs, linked from the summary.
    assert [Path(p).name for p in saved["plots"]] == [
        "acceptance_by_position.png", "speedup_vs_k.png", "speedup_vs_concurrency.png",
        "latency_percentiles.png",
    ]  # fmt: skip
    for path in saved["plots"]:
        assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({Path(path).name})" in text
    assert files["markdown"].endswith("report.md")
    # Without matplotlib the report says how to get the plots instead.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    write_report(report, tmp_path / "no-plots")
    assert "matplotlib is not installed" in (tmp_path / "no-plots" / "report.md").read_text()
    assert not list((tmp_path / "no-plots").glob("*.png"))


def test_failing_requests_count_as_errors_and_the_sweep_goes_on():
    model = tiny_llama(vocab_size=VOCAB)
    records = [PromptRecord("abcabc", "qa", 6), PromptRecord("defdef", "qa", 6)]
    config = BenchConfig(drafters=["ngram"], sizes=[2], batches=[1], adaptive=False)
    with torch.no_grad():
        report = run_sweep(
            model, CharTokenizer(), records, config, lambda s, k: FailingDrafter(k), False
        )
    (cell,) = report["cells"]
    assert cell["metrics"]["error_rate"] == 1.0
    assert {e.split(" (")[0] for e in cell["errors"].values()} == {"RuntimeError: boom"}
    assert report["baseline"]["1"]["error_rate"] == 0.0
    assert [(f["cell"], f["side"]) for f in report["failed_requests"]] == [
        ("ngram:3", "speculative warm-up"),
        ("ngram:3", "speculative"),
        ("ngram:3", "speculative"),
    ]


class FailingFirst(NGramDrafter):
    """Raises in its first proposal only: the warm-up's request fails, the measured ones not."""

    proposals = 0

    def propose(self, state):
        self.proposals += 1
        if self.proposals == 1:
            raise RuntimeError("first call")
        return super().propose(state)


def test_a_request_failing_in_the_warm_up_is_a_failed_request():
    # Warm-ups are where a sweep's compilations run: their failures were dropped unreported.
    model = tiny_llama(vocab_size=VOCAB)
    records = [PromptRecord("abcabc", "qa", 6, id="p0"), PromptRecord("defdef", "qa", 6)]
    config = BenchConfig(drafters=["ngram"], sizes=[2], batches=[1], adaptive=False)
    with torch.no_grad():
        report = run_sweep(
            model, CharTokenizer(), records, config, lambda s, k: FailingFirst(k), False
        )
    (failure,) = report["failed_requests"]
    assert (failure["cell"], failure["side"], failure["prompt_id"]) == (
        "ngram:3",
        "speculative warm-up",
        "p0",
    )
    assert failure["error"].startswith("RuntimeError: first call")
    assert report["cells"][0]["metrics"]["error_rate"] == 0.0  # the measured requests passed


def test_a_size_a_drafter_refuses_fails_the_sweep_before_anything_runs(tmp_path, monkeypatch):
    """A block chain's k past the block's positions (b - 1 for DFlash) is refused by the
    drafter: the sweep fails at its start, naming every refused cell, not after the baseline
    and the cells before it have run."""
    import specdec_fast.harness.sweep as sweep
    from specdec_fast.heads.block import DFlashHead

    model = tiny_llama(vocab_size=VOCAB)
    torch.manual_seed(0)
    head = DFlashHead.for_target(model, num_layers=1, block_size=4, mask_token_id=VOCAB - 1)
    head.save_pretrained(tmp_path / "head")
    records = [PromptRecord("abcabc", "qa", 4)]
    config = BenchConfig(
        drafters=[f"block-chain:{tmp_path / 'head'}"], sizes=[2, 3, 4, 5], batches=[1]
    )
    monkeypatch.setattr(sweep, "decode_paired", lambda *args, **kwargs: pytest.fail("ran"))
    with pytest.raises(ValueError) as refused:
        run_sweep(model, CharTokenizer(), records, config, progress=False)
    message = str(refused.value)
    assert "cannot be built (leave those sizes out of the grid" in message
    spec = f"block-chain:{tmp_path / 'head'}"
    refusal = "a chain of {} tokens is longer than the block's 3 positions"
    assert f"{spec}:4: max_nodes=5: {refusal.format(4)}" in message
    # One reason, named once with every cell it refuses.
    assert f"{spec}:5, adaptive({spec}:5): max_nodes=6: {refusal.format(5)}" in message
    assert f"{spec}:3:" not in message  # k = 3 fills the block's 3 positions: it is built
    # A checkpoint that does not load refuses every size, for one reason given once.
    config = BenchConfig(drafters=[f"draft:{tmp_path / 'none'}"], sizes=[1, 2], batches=[1])
    with pytest.raises(ValueError) as refused:
        run_sweep(model, CharTokenizer(), records, config, progress=False)
    message = str(refused.value)
    assert message.count("is neither a folder nor a bundled model") == 1
    assert "leave those sizes" not in message


def test_bench_help_and_bad_grid(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    assert "--drafter" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "--k", "0,2", "--out", "x"])
    assert "expected positive integers" in capsys.readouterr().err


@pytest.mark.skipif(
    "tiny-code" not in bundled.available(),
    reason="the bundled target tiny-code is not in this install yet (it is being trained)",
)
def test_the_issue_sweep_on_the_bundled_models_fails_no_request_and_keeps_greedy_outputs(
    tmp_path, capsys
):
    """Issue 50's sweep (n-gram and the draft model, k 1 and 3, batch 1 and more, adaptive
    cells), cut to code prompts and few tokens: no request fails, and every cell's greedy
    outputs are plain decoding's. Eager steps (the measured CPU default for a sweep this
    small, printed as the rule); compiled steps are tested in test_compiled_step.py."""
    prompts = tmp_path / "prompts.jsonl"
    records = [r.to_dict() for r in default_prompts() if r.task == "code"][:3]
    prompts.write_text("".join(json.dumps(r | {"max_new_tokens": 10}) + "\n" for r in records))
    code = main(
        ["bench", "--model", "tiny-code", "--drafter", "ngram", "--drafter",
         "draft:tiny-code-draft", "--k", "1,3", "--batch", "1,2", "--prompts", str(prompts),
         "--out", str(tmp_path / "report"), "--device", "cpu", "--dtype", "float32",
         "--no-chat"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err
    assert "bench: CPU: compile when" in err and "-> eager" in err  # the rule, at the start
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["failed_requests"] == []
    assert report["timing"]["compile_choice"]["compile"] is False
    assert report["config"]["chat"] is False
    # --k 1,3: N = 2 and 4 verified tokens for the n-gram tree and the draft chain alike.
    names = ["ngram:2", "ngram:4", "adaptive(ngram:4)", "draft:tiny-code-draft:1",
             "draft:tiny-code-draft:3", "adaptive(draft:tiny-code-draft:3)"]  # fmt: skip
    assert [(c["name"], c["batch"]) for c in report["cells"]] == [
        (name, batch) for batch in (1, 2) for name in names
    ]
    for cell in report["cells"]:
        assert cell["metrics"]["error_rate"] == 0.0 and cell["errors"] == {}
        if cell["batch"] == 1:  # one row a call: the steps of all its calls make its tokens
            m = cell["metrics"]
            assert round(m["steps"] * m["mean_accepted_tokens_per_step"]) == m["new_tokens"]
        q = cell["quality"]
        assert q["greedy_exact_matches"] == q["greedy_prompts"] == 3
        assert q["quality_regressions"] == 0
        assert cell["timing"]["measured_s"] > 0 and cell["timing"]["compile_s"] == 0.0
    drafted = [c for c in report["cells"] if c["name"] == "draft:tiny-code-draft:3"]
    assert drafted[0]["metrics"]["accepted_tokens"] > 0  # the trained pair agrees sometimes
    assert "0 failed requests" in err and "eta" in err
    text = (tmp_path / "report" / "report.md").read_text()
    assert "Steps: CPU: compile when" in text and "FAILED" not in text


def test_a_failed_request_fails_bench_loudly_after_the_report_is_written(
    tmp_path, monkeypatch, capsys
):
    """A request that raises makes `bench` exit 1 naming the cell, the prompt and the error;
    the report is written first and lists the failure."""
    import specdec_fast.harness as harness

    model = tiny_llama(vocab_size=VOCAB)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "abcabc", "id": "p0", "max_new_tokens": 4}\n')
    monkeypatch.setattr("specdec_fast.loading.load_tokenizer", lambda name: CharTokenizer())
    monkeypatch.setattr("specdec_fast.loading.load_model", lambda *args: model)
    sweep = harness.run_sweep
    monkeypatch.setattr(
        harness,
        "run_sweep",
        lambda *args, **kwargs: sweep(*args, lambda spec, k: FailingDrafter(k), **kwargs),
    )
    out = tmp_path / "report"
    code = main(
        ["bench", "--model", "m", "--drafter", "ngram", "--k", "2", "--batch", "1",
         "--no-adaptive", "--prompts", str(prompts), "--out", str(out), "--no-compile"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1
    # The warm-up's request first, then the measured one.
    assert "specdec-fast bench: error: FailedRequests: 2 failed requests" in err
    assert "ngram:3 b=1 prompt 'p0' (speculative warm-up): RuntimeError: boom" in err
    assert "1 FAILED requests" in err  # the cell's progress line counts its measured runs
    warm_up, measured = json.loads((out / "report.json").read_text())["failed_requests"]
    assert warm_up["side"] == "speculative warm-up" and measured["side"] == "speculative"
    assert measured["cell"] == "ngram:3"
    assert measured["error"].startswith("RuntimeError: boom (test_harness.py:")
    assert "## FAILED REQUESTS: 2" in (out / "report.md").read_text()


def test_eta_predicts_the_cells_left_from_measured_steps_per_batch_size():
    eta = Eta([(1, 100), (1, 200), (4, 50), (4, 50)])
    assert eta.total_steps == 400 and eta.seconds_left() is None
    eta.finished(2.0, warmup_s=3.0)  # 0.02 s a step at batch 1
    # Batch 1 at its own rate; batch 4, not measured yet, at the overall one; one warm-up left.
    assert eta.seconds_left(warmups_left=1) == pytest.approx(200 * 0.02 + 100 * 0.02 + 3.0)
    eta.finished(40.0, warmup_s=0.0)  # a cell slowed 10x by other load on the machine
    eta.finished(5.0, warmup_s=1.0)  # 0.1 s a step at batch 4
    assert eta.seconds_left() == pytest.approx(50 * 0.1)
    eta.finished(5.0, warmup_s=0.0)
    assert eta.seconds_left() == 0.0
    slow = Eta([(1, 100)] * 4)
    for seconds in (2.0, 20.0, 2.0):
        slow.finished(seconds, warmup_s=0.0)
    assert slow.seconds_left() == pytest.approx(2.0)  # the median cell's rate, not the mean's


def test_cpu_sweeps_compile_only_when_the_saving_beats_the_compilations():
    small = choose_compile(step_s=0.01, sweep_steps=10_000, shapes=10)  # 100 s eager
    assert not small.compile and "-> eager" in small.rule
    assert small.eager_estimate_s == pytest.approx(100.0)
    assert small.compile_estimate_s == pytest.approx(10 * CPU_COMPILE_S_PER_SHAPE)
    saving = 1.0 - 1.0 / CPU_COMPILED_SPEEDUP
    needed = 10 * CPU_COMPILE_S_PER_SHAPE / saving  # eager seconds that break even
    assert choose_compile(0.01, int(needed / 0.01 * 1.1), 10).compile
    assert not choose_compile(0.01, int(needed / 0.01 * 0.9), 10).compile


def test_a_drafter_or_batch_given_twice_is_one_point_of_the_grid():
    config = BenchConfig(drafters=["ngram", "suffix", "ngram"], sizes=[2, 2], batches=[4, 1, 4])
    assert config.drafters == ["ngram", "suffix"] and config.batches == [4, 1]
    assert [name for name, _, _, _ in config.cells()] == [
        "ngram:3", "adaptive(ngram:3)", "suffix:3", "adaptive(suffix:3)"
    ]  # fmt: skip


def test_cell_names_are_specs_the_command_line_takes():
    """A grafted lookup's spec follows its drafter's size in a cell's name, as `--drafter`
    writes it: `eagle:PATH:8+ngram:8`, not `eagle:PATH+ngram:8:8`."""
    config = BenchConfig(drafters=["eagle:heads+ngram:8", "draft:small"], sizes=[1, 7], trees=[4])
    names = [name for name, _, _, _ in config.cells()]
    assert names == [
        "eagle:heads:2+ngram:8", "eagle:heads:8+ngram:8", "eagle:heads:4+ngram:8",
        "adaptive(eagle:heads:8+ngram:8)", "draft:small:1", "draft:small:7",
        "draft-tree:small:4", "adaptive(draft:small:7)",
    ]  # fmt: skip
    for name, spec, size, _ in config.cells():
        text = name.removeprefix("adaptive(").removesuffix(")")
        assert DrafterSpec.parse(text) == spec.with_size(size)


def test_the_best_configuration_must_beat_plain_decoding_by_more_than_the_noise():
    """The best of many cells is the luckiest too: within the batch's noise it recommends plain
    decoding, naming the cell."""

    def cell(name, batch, code, qa):
        tasks = {"code": {"speedup_tpot": code}, "qa": {"speedup_tpot": qa}}
        return {"name": name, "batch": batch, "splits": {"task": tasks}}

    report = {
        "noise": {"1": 0.1, "4": 0.3},
        "cells": [cell("ngram:3", 1, 1.05, 1.4), cell("ngram:5", 1, 1.08, 0.9),
                  cell("ngram:3", 4, 1.25, 0.7)],
    }  # fmt: skip
    best = best_by_task(report)
    assert best["code"]["1"] == {
        "cell": "ngram:5", "speedup": 1.08, "noise": 0.1, "recommended": False
    }  # fmt: skip
    assert best["qa"]["1"]["recommended"] and best["qa"]["1"]["cell"] == "ngram:3"
    assert not best["code"]["4"]["recommended"]  # 1.25x within a noise of 30%


def test_a_log_only_route_keeps_speculating_with_its_broken_bounds_listed():
    logged = GuardrailPolicy(min_acceptance_rate=0.3, fallback_action="log_only")
    guardrails = Guardrails(routes={"qa": logged, "code": GuardrailPolicy(min_acceptance_rate=0.3)})
    cell = {"acceptance_rate": 0.5, "tpot_s": {"p95": 1.0}, "error_rate": 0.0}
    cell["quality_regressions"] = 0
    tasks = {"qa": {"acceptance_rate": 0.2}, "code": {"acceptance_rate": 0.2}}
    verdicts = guardrail_verdict(guardrails, cell, {"tpot_s": {"p95": 1.0}}, {"task": tasks})
    assert verdicts["qa"] == {"speculate": True, "broken": ["acceptance 0.200 < 0.3"]}
    assert verdicts["code"] == {"speculate": False, "broken": ["acceptance 0.200 < 0.3"]}
    assert verdicts["all"] == {"speculate": True, "broken": []}
