"""Graphs and seconds of each drafter's first `generate` call on the bundled tiny-code target
(batch 1, 32 new tokens, compiled, one thread), one process for all drafters: a first step that
met its drafter's step with other inputs than the later steps compiled one graph more.

    python bench/results/unbacked-cache-rows-cpu-2026-12-07/first_call.py SPEC...
"""

import sys
import time

import torch

from specdec_fast import generate
from specdec_fast.compiled import graphs_compiled
from specdec_fast.drafters.registry import DrafterSpec
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.prompts import load_code_prompts

torch.set_num_threads(1)
target = load_model("tiny-code", torch.device("cpu"))
tokenizer = load_tokenizer("tiny-code")
prompt = [tokenizer.bos_token_id]
prompt += tokenizer.encode(load_code_prompts(1)[0]["prompt"], add_special_tokens=False)
for spec in sys.argv[1:]:
    make = DrafterSpec.parse(spec).factory(target)
    before, start = graphs_compiled(), time.perf_counter()
    out = generate(target, [prompt], drafter=make(), max_new_tokens=32, compile=True)
    seconds, graphs = time.perf_counter() - start, graphs_compiled() - before
    print(f"{spec}: first call {graphs} graphs, {seconds:.1f} s, {len(out.stats.compiled)} labels")
