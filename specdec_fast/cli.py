"""The `specdec-fast` command line: `demo` (the main job), `generate` and `bench`."""

import argparse
import sys


def _not_built(name: str, issue: str) -> int:
    print(
        f"specdec-fast {name}: not built yet ({issue}). The kernels are importable as "
        "specdec_fast.kernels; run the tests with `bash run.sh test`.",
        file=sys.stderr,
    )
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdec-fast",
        description="Fast, lossless speculative decoding for Hugging Face causal LMs.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser(
        "demo",
        help="speculative decoding on the bundled model pair, side by side with plain decoding",
        description="Complete held-out code prompts with plain decoding and every drafter.",
    )
    sub.add_parser(
        "generate",
        help="complete one prompt with a chosen drafter",
        description="Complete a prompt with speculative decoding and print a stats summary.",
    )
    sub.add_parser(
        "bench",
        help="measure speculation on your own prompts (acceptance, latency, throughput)",
        description="Benchmark drafters against plain decoding on a JSONL prompt set.",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        return _not_built("demo", "the bundled model family and demo are tracked in issue 6")
    if args.command == "generate":
        return _not_built("generate", "the engine is tracked in issue 5")
    return _not_built("bench", "the evaluation harness is tracked in issue 8")


if __name__ == "__main__":
    sys.exit(main())
