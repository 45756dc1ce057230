"""Graphs compiled by each of four `generate` calls on one bundled tiny-code target, batches
1, 8, 1, 8 (compiled steps, one thread): the third call used to compile every batch-1 step
kind again over the storage rows the batch-8 call left.

    python bench/results/unbacked-cache-rows-cpu-2026-12-07/recompile.py SPEC
"""

import sys
import time

import torch

from specdec_fast import generate
from specdec_fast.compiled import graphs_compiled
from specdec_fast.drafters.registry import DrafterSpec
from specdec_fast.loading import load_model

torch.set_num_threads(1)
target = load_model("tiny-code", torch.device("cpu"))
spec = sys.argv[1] if len(sys.argv) > 1 else "none"
make = (lambda: None) if spec == "none" else DrafterSpec.parse(spec).factory(target)
prompts = [[1, 5 + i, 7, 9, 11, 13] for i in range(8)]
for batch in (1, 8, 1, 8):
    before, start = graphs_compiled(), time.perf_counter()
    out = generate(
        target, prompts[:batch], drafter=make(), max_new_tokens=12, eos_token_id=[], compile=True
    )
    seconds = time.perf_counter() - start
    print(
        f"B={batch} graphs {graphs_compiled() - before} {seconds:.1f} s", sorted(out.stats.compiled)
    )
