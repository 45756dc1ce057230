"""Recompilation hunt at batch 8 with rows finishing: per drafter SPEC (or `none`), five calls on
the bundled tiny-code target, batches 8, 8, 5, 1 and 8 over other code prompts each (40-58
tokens), stopping at the three tokens plain decoding emits most (so rows end at different steps
and the last ones decode alone), 64 new tokens at most; the graphs each call compiled (dynamo's
capture, its `eager` backend; `TORCH_LOGS=recompiles` says why each compiled).

    python bench/results/serving-warmup-cpu-2026-12-07/hunt/hunt.py SPEC
"""

import functools
import sys
import time
from collections import Counter

import torch

from specdec_fast import generate
from specdec_fast.compiled import graphs_compiled
from specdec_fast.drafters.registry import DrafterSpec
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.prompts import load_code_prompts

PLAN = [(8, 0), (8, 8), (5, 16), (1, 21), (8, 22)]  # (batch, first prompt)


def main() -> None:
    torch.compile = functools.partial(torch.compile, backend="eager")
    torch.set_num_threads(1)
    target = load_model("tiny-code", torch.device("cpu"))
    tokenizer = load_tokenizer("tiny-code")
    spec = sys.argv[1]
    make = (lambda: None) if spec == "none" else DrafterSpec.parse(spec).factory(target)
    records = load_code_prompts()
    ids = [tokenizer.encode(r["prompt"])[-40 - 3 * (i % 7) :] for i, r in enumerate(records)]
    plain = generate(
        target, ids[:8], drafter=None, max_new_tokens=32, eos_token_id=[], compile=False
    )
    emitted = Counter(
        t for s, p in zip(plain.sequences, ids[:8], strict=True) for t in s.tolist()[len(p) :]
    )
    eos = [token for token, _ in emitted.most_common(3)]
    print("eos", eos, [tokenizer.decode([t]) for t in eos])
    for batch, first in PLAN:
        prompts = [ids[(first + j) % len(ids)] for j in range(batch)]
        before, start = graphs_compiled(), time.perf_counter()
        out = generate(
            target, prompts, drafter=make(), max_new_tokens=64, eos_token_id=eos, compile=True
        )
        new = sorted(len(s) - len(p) for s, p in zip(out.sequences, prompts, strict=True))
        seconds = time.perf_counter() - start
        graphs = graphs_compiled() - before
        print(f"{spec} T=0.0 B={batch} graphs {graphs} {seconds:.1f} s new {new}", flush=True)


if __name__ == "__main__":
    main()
