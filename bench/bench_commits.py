"""Two source trees side by side: tokens/s of `generate` per drafter, old against new.

A change that claims "no drafter slower than before" is checked here: each tree runs in its own
worker process (its own virtual environment, `TREE/.venv`, where the project is installed
editable), both workers load the bundled tiny-code family, and every round times each drafter
once in each tree in turn (old, new, then new, old in the next round), so that machine noise
falls on both alike. Reported per drafter: the median tokens/s of each tree, the median of the
per-round ratios new/old with its min-max, and whether the greedy outputs are equal across the
trees (and to the new tree's plain decoding).

`--temperature T` samples instead (top-k, top-p off) with seed `--seed`: a sampled chain (a draft
model's, a block drafter's) takes its own path through the step. Outputs then equal plain
decoding's only for drafters whose proposals are deterministic (`DrafterKind.deterministic`).

    python bench/bench_commits.py --old /path/to/old/tree --new . --drafter none \
        --drafter eagle:tiny-code-eagle:16 --rounds 5

Steps compile (`--eager` runs them eagerly) in an untimed warm-up call per drafter.
`--json PATH` writes the records.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_DRAFTERS = (
    "none",
    "ngram:8",
    "draft:tiny-code-draft:4",
    "draft-tree:tiny-code-draft:16",
    "medusa:tiny-code-medusa:16",
    "eagle:tiny-code-eagle:16",
    "eagle:tiny-code-eagle3:16",
    "block:tiny-code-dflash:16",
    "block:tiny-code-pard:16",
)


def worker(
    compile: bool, prompts: int, tokens: int, threads: int, temperature: float, seed: int
) -> None:
    """Answer JSON requests on stdin, one per line: {"spec": S} times one `generate` with that
    drafter (warming it up first the first time) and prints {"tokens_per_s", "outputs"}."""
    import torch

    from specdec_fast import generate
    from specdec_fast.drafters.registry import DrafterSpec
    from specdec_fast.loading import load_model, load_tokenizer
    from specdec_fast.prompts import load_code_prompts

    torch.set_num_threads(threads)
    target = load_model("tiny-code", torch.device("cpu"))
    tokenizer = load_tokenizer("tiny-code")
    ids = [
        [tokenizer.bos_token_id, *tokenizer.encode(r["prompt"], add_special_tokens=False)]
        for r in load_code_prompts(prompts)
    ]
    makers, warm = {}, set()

    def run(spec: str):
        if spec not in makers:
            makers[spec] = (
                (lambda: None) if spec == "none" else DrafterSpec.parse(spec).factory(target)
            )
        out = generate(
            target,
            ids,
            drafter=makers[spec](),
            max_new_tokens=tokens,
            eos_token_id=[],
            compile=compile,
            temperature=temperature,
            seed=seed,
        )
        return out

    for line in sys.stdin:
        spec = json.loads(line)["spec"]
        if spec not in warm:
            run(spec)
            warm.add(spec)
        start = time.perf_counter()
        out = run(spec)
        seconds = time.perf_counter() - start
        generated = sum(len(s) for s in out.sequences) - sum(len(p) for p in ids)
        reply = {
            "tokens_per_s": generated / seconds,
            "outputs": [s.tolist() for s in out.sequences],
        }
        print(json.dumps(reply), flush=True)


def tree_python(tree: Path) -> Path:
    """The interpreter that imports `tree`'s specdec_fast: its own `.venv`, or this process's
    when `tree` is the tree this file belongs to."""
    python = tree / ".venv" / "bin" / "python"
    if python.exists():
        return python
    if tree.resolve() == Path(__file__).resolve().parents[1]:
        return Path(sys.executable)
    raise SystemExit(f"{python} not found: run `bash run.sh setup` in {tree} first")


class Worker:
    def __init__(self, tree: Path, args):
        python = tree_python(tree)
        command = [
            str(python),
            str(Path(__file__).resolve()),
            "--worker",
            "--prompts",
            str(args.prompts),
            "--tokens",
            str(args.tokens),
            "--threads",
            str(args.threads),
        ]
        if args.eager:
            command.append("--eager")
        if args.temperature:
            # Only then: a tree from before the option runs greedy steps with the same command.
            command += ["--temperature", str(args.temperature), "--seed", str(args.seed)]
        self.process = subprocess.Popen(
            command, cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def time(self, spec: str) -> dict:
        self.process.stdin.write(json.dumps({"spec": spec}) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"worker for {spec} died (see its stderr above)")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def compare(args) -> list[dict]:
    workers = {"old": Worker(args.old.resolve(), args), "new": Worker(args.new.resolve(), args)}
    records = []
    plain = None
    try:
        for spec in args.drafter:
            rates = {"old": [], "new": []}
            ratios, outputs = [], {}
            for round_index in range(args.rounds):
                order = ("old", "new") if round_index % 2 == 0 else ("new", "old")
                for name in order:
                    reply = workers[name].time(spec)
                    rates[name].append(reply["tokens_per_s"])
                    outputs[name] = reply["outputs"]
                ratios.append(rates["new"][-1] / rates["old"][-1])
            if spec == "none":
                plain = outputs["new"]
            record = {
                "drafter": spec,
                "old_tokens_per_s": statistics.median(rates["old"]),
                "new_tokens_per_s": statistics.median(rates["new"]),
                "ratio": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "outputs_equal": outputs["old"] == outputs["new"],
                "equals_plain": None if plain is None else outputs["new"] == plain,
            }
            records.append(record)
            print(
                f"{spec:32s} old {record['old_tokens_per_s']:7.1f}  new "
                f"{record['new_tokens_per_s']:7.1f} tok/s  new/old {record['ratio']:.3f}x "
                f"({record['ratio_min']:.2f}-{record['ratio_max']:.2f})  outputs equal: "
                f"{record['outputs_equal']}  equal plain: {record['equals_plain']}",
                flush=True,
            )
    finally:
        for process in workers.values():
            process.close()
    return records


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's options, the drafters defaulted; `--old` is required of a comparison."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, help="the tree before the change")
    parser.add_argument("--new", type=Path, default=Path("."), help="the tree after it")
    parser.add_argument("--drafter", action="append", help="drafter spec (repeatable)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eager", action="store_true", help="eager steps (default: compiled)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--seed", type=int, default=0, help="the sampled runs' seed")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.old is None and not args.worker:
        parser.error("--old is required")
    args.drafter = args.drafter or list(DEFAULT_DRAFTERS)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(not args.eager, args.prompts, args.tokens, args.threads, args.temperature, args.seed)
        return
    records = compare(args)
    if args.json:
        settings = {key: str(value) for key, value in vars(args).items()}
        args.json.write_text(json.dumps({"args": settings, "records": records}, indent=1))


if __name__ == "__main__":
    main()
