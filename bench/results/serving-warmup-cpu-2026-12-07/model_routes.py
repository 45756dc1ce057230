"""The warm-up over model-drafter routes, then traffic unlike it: graphs compiled by each.

The bundled tiny-code target with routes of the given SPECs (drafters from one factory per
spec, as `Service` builds them: the warm-up's and the served drafters share their models),
dynamo's capture only (its `eager` backend), one thread. The traffic per route: a lone request,
five at once (every other one sampled) and two joining them three steps later (one sampled with
both filters), the model's own EOS id, 8 code prompts of 30-79 tokens.

    python bench/results/serving-warmup-cpu-2026-12-07/model_routes.py SPEC...
"""

import functools
import sys

import torch

from specdec_fast.compiled import graphs_compiled
from specdec_fast.drafters.registry import DrafterSpec
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.prompts import load_code_prompts
from specdec_fast.serving import Request, Scheduler
from specdec_fast.serving.warmup import warm_up


def main() -> None:
    torch.compile = functools.partial(torch.compile, backend="eager")
    torch.set_num_threads(1)
    target = load_model("tiny-code", torch.device("cpu"))
    tokenizer = load_tokenizer("tiny-code")
    specs = sys.argv[1:]
    factories = {spec: DrafterSpec.parse(spec).factory(target) for spec in specs}

    def routes() -> dict:
        return {spec: factories[spec](DrafterSpec.parse(spec).size) for spec in specs}

    options = {"max_batch": 8, "max_cache_len": 512, "compile": True}
    warmed = warm_up(target, routes(), **options)
    print([(w.route, w.graphs, round(w.seconds, 1), w.drafter_errors) for w in warmed])
    scheduler = Scheduler(target, routes(), **options)
    records = load_code_prompts(8)
    prompts = [tokenizer.encode(r["prompt"])[-30 - 7 * i :] for i, r in enumerate(records)]
    before = graphs_compiled()
    for route in specs:
        handles = [scheduler.submit(Request(prompts[0], 12, route=route))]
        scheduler.run_until_idle()
        handles += [
            scheduler.submit(Request(p, 6 + 3 * i, route=route, temperature=0.7 * (i % 2), seed=i))
            for i, p in enumerate(prompts[1:6])
        ]
        scheduler.run_until_idle(max_steps=3)
        filtered = Request(prompts[6], 9, route=route, top_k=20, top_p=0.9, temperature=1.0)
        greedy = Request(prompts[7], 5, route=route)
        handles += [scheduler.submit(filtered), scheduler.submit(greedy)]
        scheduler.run_until_idle()
        reasons = [h.completion.finish_reason for h in handles]
        print(route, "traffic graphs", graphs_compiled() - before, reasons, flush=True)
    scheduler.close()


if __name__ == "__main__":
    main()
