"""The first requests a compiled server serves, with and without its warm-up: the bundled
tiny-code target, routes `default` (n-gram, N = 8) and `plain`, inductor's compile (one
thread). Start-up is the `Service`'s construction (the warm-up included); then, on the default
route, a lone request, a pair, a sampled one and a newcomer joining it, each request's latency
(arrival to end) and the graphs compiled while they ran.

    python bench/results/serving-warmup-cpu-2026-12-07/first_requests.py --warm-up|--no-warm-up
"""

import argparse
import json
import time

import torch

from specdec_fast.compiled import graphs_compiled
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.prompts import load_code_prompts
from specdec_fast.serving import Request
from specdec_fast.serving.routes import server_routes
from specdec_fast.serving.service import Service

parser = argparse.ArgumentParser()
parser.add_argument("--warm-up", action=argparse.BooleanOptionalAction, required=True)
args = parser.parse_args()
torch.set_num_threads(1)
model = load_model("tiny-code", torch.device("cpu"))
tokenizer = load_tokenizer("tiny-code")
prompts = [tokenizer.encode(r["prompt"])[-48:] for r in load_code_prompts(6)]
start = time.perf_counter()
service = Service(
    model, tokenizer, server_routes("ngram:8", []), compile=True, warm_up=args.warm_up
)
startup = time.perf_counter() - start
scheduler = service.scheduler
before = graphs_compiled()
waves = [
    ("lone", [Request(prompts[0], 32, eos_token_id=[])]),
    ("pair", [Request(p, 32, eos_token_id=[]) for p in prompts[1:3]]),
    ("sampled", [Request(prompts[3], 32, eos_token_id=[], temperature=0.8, seed=0)]),
]
latencies = {}
for name, requests in waves:
    handles = [scheduler.submit(r) for r in requests]
    if name == "sampled":
        scheduler.run_until_idle(max_steps=2)
        handles.append(scheduler.submit(Request(prompts[4], 16, eos_token_id=[])))
    scheduler.run_until_idle()
    latencies[name] = [round(h.completion.finished - h.completion.arrival, 2) for h in handles]
scheduler.close()
record = {
    "warm_up": args.warm_up,
    "startup_s": round(startup, 1),
    "warm_up_routes": [(w.route, w.graphs, round(w.seconds, 1)) for w in service.warm_up],
    "latency_s": latencies,
    "graphs_compiled_while_serving": graphs_compiled() - before,
}
print(json.dumps(record))
