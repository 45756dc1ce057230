"""The command line: `specdec-fast generate` on small models written by the test, as users hold
them (HF folders with and without a chat template, a GGUF file), with dtype and device options,
special tokens skipped, and progress on stderr only where stderr is a terminal."""

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest
import torch
from tiny_models import tiny_llama, write_gguf
from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

from specdec_fast import gguf_files
from specdec_fast.cli import main
from specdec_fast.loading import MissingExtra, auto_dtype, load_model, load_tokenizer
from specdec_fast.text import encode_prompt

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEXT = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n"] * 20


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXT, vocab_size=300, min_frequency=1, special_tokens=["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(folder)
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A chat model whose every next token is `<eos>` (id 0): its LM head is zero, so all logits
    tie and greedy decoding picks the lowest id."""
    folder = tmp_path_factory.mktemp("tiny-chat")
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    model = tiny_llama(vocab_size=len(tokenizer))
    torch.nn.init.zeros_(model.lm_head.weight)
    model.save_pretrained(folder)
    assert tokenizer.eos_token_id == 0
    return folder


def cli(*args, stderr=subprocess.PIPE):
    """Run the command line in a fresh interpreter, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "specdec_fast", *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        check=False,
    )


def cli_in_process(capsys, *args):
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def generate_json(capsys, model, *extra):
    code, out, err = cli_in_process(
        capsys, "generate", "--model", str(model), "--prompt", "def add(a, b):",
        "--max-new-tokens", "12", "--json", "--device", "cpu", *extra,
    )  # fmt: skip
    assert code == 0, err
    return json.loads(out), err


@pytest.mark.parametrize("drafter", ["none", "ngram:4", "suffix", "draft:{model}:2"])
def test_generate_json(model_dir, drafter, capsys):
    record, err = generate_json(capsys, model_dir, "--drafter", drafter.format(model=model_dir))
    assert record["prompt"] == "def add(a, b):" and record["chat"] is False
    assert 1 <= record["stats"]["new_tokens"] <= 12
    # Stderr is not a terminal here: no progress, no loading bars, no tokenizer warnings.
    assert err == ""


def test_generate_text_output(model_dir):
    result = cli(
        "generate", "--model", str(model_dir), "--prompt", "for i in", "--max-new-tokens", "6",
        "--device", "cpu",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("for i in")  # a raw completion continues the prompt
    assert "tok/s" in result.stdout
    assert result.stderr == ""


def test_progress_is_one_line_on_a_terminal(model_dir):
    """With stderr on a pseudo-terminal the bar rewrites one line; stdout keeps the JSON."""
    leader, follower = pty.openpty()
    # A terminal of 100 columns (a fresh pseudo-terminal has none, and tqdm draws nothing).
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        result = cli(
            "generate", "--model", str(model_dir), "--prompt", "for i in",
            "--max-new-tokens", "24", "--json", "--device", "cpu", stderr=follower,
        )  # fmt: skip
        os.close(follower)
        follower = None
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal is closed once everything was read
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(leader)
        if follower is not None:
            os.close(follower)
    assert result.returncode == 0
    assert json.loads(result.stdout)["stats"]["new_tokens"] >= 1
    terminal = b"".join(chunks).decode()
    assert "generate" in terminal and "tok" in terminal
    assert "\n" not in terminal.strip("\r\n")  # one line, rewritten with carriage returns


def test_chat_template_by_default_and_special_tokens_skipped(chat_dir, capsys):
    tokenizer = load_tokenizer(str(chat_dir))
    templated = encode_prompt(tokenizer, "def add(a, b):")
    raw = encode_prompt(tokenizer, "def add(a, b):", chat=False)
    assert len(templated) > len(raw)
    record, _ = generate_json(capsys, chat_dir)
    assert record["chat"] is True and record["prompt_tokens"] == len(templated)
    # The answer is the end-of-turn token at once (the tokenizer's EOS stops it), skipped.
    assert record["stats"]["new_tokens"] == 1 and record["completion"] == ""
    kept, _ = generate_json(capsys, chat_dir, "--keep-special-tokens")
    assert kept["completion"] == "<eos>"
    plain, _ = generate_json(capsys, chat_dir, "--no-chat")
    assert plain["chat"] is False and plain["prompt_tokens"] == len(raw)


def test_chat_without_a_template_is_a_clear_error(model_dir, capsys):
    code, _, err = cli_in_process(
        capsys, "generate", "--model", str(model_dir), "--prompt", "x", "--chat"
    )
    assert code == 2 and "the tokenizer has no chat template" in err


def test_dtype_and_device_options(model_dir, capsys):
    cpu = torch.device("cpu")
    assert load_model(str(model_dir), cpu).dtype == torch.float32  # auto on the CPU
    assert load_model(str(model_dir), cpu, "bfloat16").dtype == torch.bfloat16
    assert auto_dtype(torch.device("cuda"), torch.float16) == torch.float16
    assert auto_dtype(torch.device("cuda"), torch.float32) == torch.bfloat16
    record, _ = generate_json(capsys, model_dir, "--dtype", "float16")
    assert record["stats"]["new_tokens"] >= 1
    code, _, err = cli_in_process(
        capsys, "generate", "--model", str(model_dir), "--prompt", "x", "--device", "tpu"
    )
    assert code == 2 and "device: expected cpu, cuda or cuda:N, got 'tpu'" in err
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(model_dir), "--prompt", "x", "--dtype", "int8"])


def test_generate_refuses_an_empty_prompt(model_dir, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--model", str(model_dir), "--prompt", ""])
    assert exited.value.code == 2
    assert "--prompt: expected a non-empty prompt" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--drafter", "foo"], "drafter spec 'foo': expected none | ngram[:N]"),
        (["--drafter", "ngram:8:8"], "drafter spec 'ngram:8:8'"),
        (["--drafter", "draft:x:4+ngram:8"], "a lookup grafts onto one tree drafter's spec"),
        (["--seed", "abc"], "argument --seed: invalid int value: 'abc'"),
    ],
)
def test_usage_errors_are_one_line(capsys, option, message):
    """argparse's errors too: the command, the argument and the registry's or argparse's
    reason, then where the usage is; no usage block."""
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--prompt", "x", *option])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("specdec-fast generate: error: ") and message in err
    assert err.strip().endswith("(see specdec-fast generate --help)")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--max-new-tokens", "0"], "--max-new-tokens: expected an integer >= 1, got 0"),
        (["bench", "--price-per-hour", "-1"], "--price-per-hour: expected a positive price"),
        (["bench", "--price-per-hour", "nan"], "--price-per-hour: expected a positive price"),
    ],
)
def test_demo_and_bench_values_are_checked_before_anything_runs(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_a_reader_that_leaves_ends_the_command_quietly(monkeypatch, capsys):
    """`specdec-fast generate ... | head -c 100`: the closed pipe stops the command with
    SIGPIPE's status and nothing on stderr."""
    from specdec_fast import cli

    def closed(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "run_generate", closed)
    assert main(["generate", "--prompt", "x"]) == 141
    assert capsys.readouterr().err == ""


def test_gguf_file_gives_the_folder_model(model_dir, tmp_path, capsys):
    pytest.importorskip("gguf", reason="the gguf package (specdec-fast[gguf]) is not installed")
    pytest.importorskip("accelerate", reason="accelerate (specdec-fast[gguf]) is not installed")
    model = load_model(str(model_dir), torch.device("cpu"))
    tokenizer = load_tokenizer(str(model_dir))
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, tokenizer, CHAT_TEMPLATE)
    from_gguf = load_model(str(path), torch.device("cpu"))
    ids = torch.tensor([tokenizer.encode("def add(a, b):")])
    torch.testing.assert_close(from_gguf(ids).logits, model(ids).logits)
    gguf_tokenizer = load_tokenizer(str(path))
    assert gguf_tokenizer.encode("for i in range(3):") == tokenizer.encode("for i in range(3):")
    # The command line on the file, with the file as the draft model too.
    record, err = generate_json(capsys, path, "--drafter", f"draft:{path}:2")
    assert record["chat"] is True  # the GGUF file's own template
    assert record["stats"]["new_tokens"] >= 1 and record["stats"]["accepted_tokens"] > 0
    assert err == ""  # no dequantization or loading bars


def test_gguf_without_the_extra_names_it(monkeypatch, tmp_path, capsys):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    monkeypatch.setattr(gguf_files.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MissingExtra, match=r"needs gguf and accelerate: pip install"):
        load_model(str(path), torch.device("cpu"))
    code, _, err = cli_in_process(capsys, "generate", "--model", str(path), "--prompt", "x")
    assert code == 2 and "pip install 'specdec-fast[gguf]'" in err


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    code, _, err = cli_in_process(
        capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "x"
    )
    assert code == 2
    assert "neither a folder nor a bundled model" in err
    code, _, err = cli_in_process(
        capsys, "generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "x"
    )
    assert code == 2 and "no such GGUF file" in err


@pytest.mark.parametrize("flag", ["--compile", "--no-compile"])
def test_compile_choice_does_not_outlive_the_command(flag, tmp_path, capsys):
    """The command's compile choice travels through SPECDEC_COMPILE; an in-process caller gets its
    own setting back, whether the command succeeds or fails."""
    before = os.environ.get("SPECDEC_COMPILE")
    code, _, _ = cli_in_process(
        capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "x", flag
    )
    assert code == 2
    assert os.environ.get("SPECDEC_COMPILE") == before


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["bench", "--model", "m", "--drafter", "ngram", "--out", "o", "--device", "cpu"], "unset"),
        (["bench", "--model", "m", "--out", "o", "--device", "cpu", "--no-compile"], "0"),
        (["bench", "--model", "m", "--out", "o", "--device", "cpu", "--compile"], "1"),
        (["generate", "--model", "m", "--prompt", "x", "--device", "cpu"], "0"),
        (["generate", "--model", "m", "--prompt", "x", "--device", "cpu", "--compile"], "1"),
    ],
)
def test_on_the_cpu_bench_decides_per_sweep_one_shot_commands_do_not_compile(
    argv, expected, monkeypatch
):
    """On the CPU, one-shot commands run eagerly; `bench` leaves the choice to its sweep (by
    measurement, `harness.plan`) unless told; the flags override either."""
    from specdec_fast.cli import _choose_compile, build_parser

    monkeypatch.setenv("SPECDEC_COMPILE", "unset")
    _choose_compile(build_parser().parse_args(argv))
    assert os.environ["SPECDEC_COMPILE"] == expected


def test_generate_exact_mode(model_dir, capsys):
    """--exact: speculative and plain completions are the same tokens; --compile is refused."""
    exact, _ = generate_json(capsys, model_dir, "--drafter", "ngram:4", "--exact")
    plain, _ = generate_json(capsys, model_dir, "--drafter", "none", "--exact")
    assert exact["exact"] is True and exact["completion"] == plain["completion"]
    code, _, err = cli_in_process(
        capsys, "generate", "--model", str(model_dir), "--prompt", "x", "--exact", "--compile"
    )
    assert code == 2 and "--compile" in err


def _bench(capsys, tmp_path, *extra):
    return cli_in_process(
        capsys, "bench", "--model", str(tmp_path / "never-loaded"), "--out", str(tmp_path / "out"),
        *extra,
    )  # fmt: skip


def test_bench_input_errors_are_one_line_and_exit_2(tmp_path, capsys):
    """Files given to bench are read before the model loads; each bad one is one line naming
    it, exit 2, no traceback."""
    code, _, err = _bench(capsys, tmp_path, "--prompts", str(tmp_path / "missing.jsonl"))
    assert code == 2 and "missing.jsonl: cannot read the prompts" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    prompts = tmp_path / "rows.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b", "temperature": NaN}\n')
    code, _, err = _bench(capsys, tmp_path, "--prompts", str(prompts))
    assert code == 2 and "rows.jsonl:2.temperature: expected" in err
    (tmp_path / "file").write_text("")
    code, _, err = cli_in_process(
        capsys, "bench", "--model", "x", "--out", str(tmp_path / "file"), "--prompts", str(prompts)
    )
    assert code == 2 and "exists and is not a folder" in err
    guardrails = tmp_path / "guard.yaml"
    guardrails.write_text("speculative_decoding_guardrails:\n  window_steps: [1\n")
    code, _, err = _bench(capsys, tmp_path, "--guardrails", str(guardrails))
    assert code == 2 and f"{guardrails}: not valid YAML at line 3" in err
    assert len(err.strip().splitlines()) == 1


def test_negative_counts_are_refused_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _bench(capsys, tmp_path, "--max-new-tokens", "-3")
    assert exit_info.value.code == 2
    assert "--max-new-tokens: expected an integer >= 1, got -3" in capsys.readouterr().err


def test_runtime_errors_exit_1_and_debug_shows_the_traceback(monkeypatch, capsys):
    from specdec_fast import cli

    def fail(args):
        raise RuntimeError("the device went away\nsecond line")

    monkeypatch.setattr(cli, "_dispatch", fail)
    code, _, err = cli_in_process(capsys, "generate", "--prompt", "x", "--device", "cpu")
    assert code == 1
    assert err == "specdec-fast generate: error: RuntimeError: the device went away second line\n"
    with pytest.raises(RuntimeError, match="the device went away"):
        main(["--debug", "generate", "--prompt", "x", "--device", "cpu"])
