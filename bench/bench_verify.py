"""Verification sampling: `verify` (two launches) against eager torch, torch.compile and FlashInfer.

GPU shapes (ANCHORS.md's sweep): stochastic chains of K = 1, 3, 5, 8 drafts with draft
probabilities (classic speculative sampling) for B in {1, 8, 32} and trees of N = 16, 64 and 65
nodes (65: what the engine launches for a 64-node budget while budgets leave the root out) with
deterministic drafts (binary trees, the first child of each node carrying its parent's argmax)
for B in {1, 8, 32, 64}, at V = 128256; K = 5 chains at V = 32000 (B 1 and 32). fp32 logits,
temperature 1, drawn on the device. `--quick`: K = 5 chains and 64/65-node trees at B 1 and 32,
without the torch.compile peer. The floor reads the logits once at the copy bandwidth measured
in the same run. Targets on an H200 (chain K=5, V=128256): B1 <= 15 us, B32 <= 90 us; a 64-node
tree at B1 <= 40 us.

Peers:
- `verify`: the public op with `validate=False`, as the engine calls it (Triton on CUDA, the
  configured backend elsewhere);
- `eager torch`: `eager_chain` / `eager_tree`, the same contract written the usual way in torch
  (softmax materialized, torch's RNG, a vectorized accept/reject for chains, one gather-and-match
  step per tree level);
- `torch.compile`: the same functions compiled (inductor on CUDA; on a CPU the `eager` backend,
  so that the smoke test traces them without a C++ build);
- `flashinfer` (CUDA chains, when flashinfer is importable): softmax, then
  `flashinfer.sampling.chain_speculative_sampling`.

Run as `pytest bench/bench_verify.py --benchmark-only` or `python bench/bench_verify.py`
(`--quick`, `--json PATH`); the script also prints each shape's speed-ups over the peers and the
fraction of the floor reached, and adds them to the JSON. On a CPU it runs the same code at small
sizes.
"""

import argparse
import importlib.util
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import torch
from common import RESULTS_DIR, Case, bench_device, device_generator, main, run_in_pytest

from specdec_fast.kernels import verify

OURS = "verify"


@dataclass(frozen=True)
class Shape:
    kind: str  # "chain" (with draft probabilities) or "tree" (deterministic drafts)
    batch: int
    num_nodes: int  # chains: K + 1
    vocab: int
    dtype: torch.dtype = torch.float32

    @property
    def label(self) -> str:
        size = f"K{self.num_nodes - 1}" if self.kind == "chain" else f"N{self.num_nodes}"
        return f"{self.kind}/{size}/B{self.batch}/V{self.vocab}"

    @property
    def logits_bytes(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return self.batch * self.num_nodes * self.vocab * element_size

    @property
    def depth(self) -> int:
        """Levels below the root of the binary tree (or the chain)."""
        return self.num_nodes - 1 if self.kind == "chain" else (self.num_nodes).bit_length() - 1


def shapes_for(device: torch.device, quick: bool) -> list[Shape]:
    if device.type != "cuda":
        if quick:
            return [Shape("chain", 2, 4, 500), Shape("tree", 2, 16, 500)]
        return [Shape("chain", b, k + 1, 1000) for b in (1, 4) for k in (1, 5)] + [
            Shape("tree", b, 16, 1000) for b in (1, 4)
        ]
    if quick:
        return [Shape("chain", b, 6, 128256) for b in (1, 32)] + [
            Shape("tree", b, n, 128256) for b in (1, 32) for n in (64, 65)
        ]
    chains = [Shape("chain", b, k + 1, 128256) for b in (1, 8, 32) for k in (1, 3, 5, 8)]
    trees = [Shape("tree", b, n, 128256) for b in (1, 8, 32, 64) for n in (16, 64, 65)]
    return chains + trees + [Shape("chain", b, 6, 32000) for b in (1, 32)]


def make_inputs(shape: Shape, device: torch.device, seed: int = 0) -> dict:
    """logits, draft_tokens, parents, draft_probs (chains) and a per-sequence seed, all drawn on
    `device`."""
    draw = dict(generator=device_generator(device, seed), device=device)
    batch, num_nodes, vocab = shape.batch, shape.num_nodes, shape.vocab
    logits = torch.randn((batch, num_nodes, vocab), **draw) * 3
    node = torch.arange(num_nodes, device=device)
    if shape.kind == "chain":
        parents = (node - 1).expand(batch, num_nodes)
        draft_logits = logits + torch.randn(logits.shape, **draw)
        draft_probs = torch.softmax(draft_logits, dim=-1)
        tokens = torch.multinomial(draft_probs.flatten(0, 1), 1, generator=draw["generator"])
        tokens = tokens.view(batch, num_nodes)
    else:
        parents = ((node - 1) // 2).expand(batch, num_nodes).clone()
        parents[:, 0] = -1
        draft_probs = None
        tokens = torch.randint(0, vocab, (batch, num_nodes), **draw)
        first_child = (node >= 1) & (node % 2 == 1)
        parent_argmax = logits.argmax(dim=-1).gather(1, parents.clamp(min=0))
        tokens = torch.where(first_child, parent_argmax, tokens)
    return {
        "logits": logits.to(shape.dtype),
        "draft_tokens": tokens,
        "parents": parents.contiguous(),
        "draft_probs": draft_probs,
        "seed": torch.randint(0, 2**62, (batch,), **draw),
    }


def eager_chain(logits, draft_tokens, draft_probs, temperature: float):
    """Speculative sampling on chains in eager torch: accept draft i with probability
    min(1, p/q), resample the first rejection from max(0, p - q), else a bonus token from p."""
    batch, num_nodes, _ = logits.shape
    rows = torch.arange(batch, device=logits.device)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    drafts = draft_tokens[:, 1:, None]
    p = probs[:, :-1].gather(-1, drafts)[..., 0]
    q = draft_probs[:, 1:].float().gather(-1, drafts)[..., 0]
    accepted = torch.rand_like(p) * q < p
    num_accepted = accepted.int().cumprod(dim=1).sum(dim=1)
    at = probs[rows, num_accepted]
    q_next = draft_probs[rows, (num_accepted + 1).clamp(max=num_nodes - 1)].float()
    leaf = (num_accepted == num_nodes - 1)[:, None]
    residual = torch.where(leaf, at, (at - q_next).clamp(min=0))
    next_tokens = (residual / torch.empty_like(residual).exponential_()).argmax(dim=-1)
    node = torch.arange(num_nodes, device=logits.device)
    accepted_nodes = torch.where(node <= num_accepted[:, None], node, -1)
    return accepted_nodes, num_accepted, next_tokens


def eager_tree(logits, draft_tokens, parents, temperature: float, depth: int):
    """Deterministic drafts in eager torch: one sample per node from the target (exponential
    race on the materialized softmax), then `depth` gather-and-match steps down the tree."""
    batch, num_nodes, _ = logits.shape
    rows = torch.arange(batch, device=logits.device)
    node = torch.arange(num_nodes, device=logits.device)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sample = (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
    current = torch.zeros(batch, dtype=torch.long, device=logits.device)
    num_accepted = torch.zeros_like(current)
    accepted_nodes = torch.full_like(parents, -1)
    accepted_nodes[:, 0] = 0
    for _ in range(depth):
        wanted = sample[rows, current]
        matching = (parents == current[:, None]) & (draft_tokens == wanted[:, None])
        child = torch.where(matching, node, num_nodes).amin(dim=1)
        advance = child < num_nodes
        num_accepted += advance
        accepted_nodes[rows, num_accepted] = torch.where(advance, child, current)
        current = torch.where(advance, child, current)
    return accepted_nodes, num_accepted, sample[rows, current]


@cache
def compiled(fn):
    backend = "inductor" if torch.cuda.is_available() else "eager"
    return torch.compile(fn, backend=backend, dynamic=True)


def flashinfer_chain(logits, draft_tokens, draft_probs, temperature: float):
    import flashinfer

    target_probs = torch.softmax(logits.float() / temperature, dim=-1)
    return flashinfer.sampling.chain_speculative_sampling(
        draft_probs[:, 1:].contiguous(), draft_tokens[:, 1:].int().contiguous(), target_probs
    )


def _builder(shape: Shape, device: torch.device, peer: str):
    def build():
        inputs = make_inputs(shape, device)
        logits, tokens, parents = inputs["logits"], inputs["draft_tokens"], inputs["parents"]
        draft_probs = inputs["draft_probs"]
        if peer == OURS:
            seed = inputs["seed"]
            return lambda: verify(
                logits, tokens, parents, draft_probs, temperature=1.0, seed=seed, validate=False
            )
        if peer == "flashinfer":
            return lambda: flashinfer_chain(logits, tokens, draft_probs, 1.0)
        if shape.kind == "chain":
            chain = eager_chain if peer == "eager torch" else compiled(eager_chain)
            return lambda: chain(logits, tokens, draft_probs, 1.0)
        tree = eager_tree if peer == "eager torch" else compiled(eager_tree)
        return lambda: tree(logits, tokens, parents, 1.0, shape.depth)

    return build


COMPILED = "torch.compile"
PEERS = (OURS, "eager torch", COMPILED)


def peers_for(shape: Shape, device: torch.device, quick: bool = False) -> list[str]:
    """Every peer; quick GPU runs leave torch.compile out (its compiles are most of a run's
    time)."""
    peers = [peer for peer in PEERS if not (quick and device.type == "cuda" and peer == COMPILED)]
    flashinfer = device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None
    return peers + (["flashinfer"] if flashinfer and shape.kind == "chain" else [])


def cases_for(device: torch.device, quick: bool) -> list[Case]:
    return [
        Case(shape.label, peer, _builder(shape, device, peer), shape.logits_bytes)
        for shape in shapes_for(device, quick)
        for peer in peers_for(shape, device, quick)
    ]


def summarize(records) -> list[dict]:
    """Per shape: our median, the fraction of the logits-read floor it reaches, and each peer's
    median divided by ours (> 1: we are faster)."""
    summary = []
    for shape in dict.fromkeys(record.shape for record in records):
        by_peer = {r.peer: r for r in records if r.shape == shape and r.median_us is not None}
        if OURS not in by_peer:
            continue
        ours = by_peer[OURS]
        summary.append(
            {
                "shape": shape,
                "ours_us": ours.median_us,
                "floor_fraction": ours.floor_us / ours.median_us,
                "speedup": {
                    peer: record.median_us / ours.median_us
                    for peer, record in by_peer.items()
                    if peer != OURS
                },
            }
        )
    return summary


def format_summary(summary: list[dict]) -> str:
    peers = list(dict.fromkeys(peer for row in summary for peer in row["speedup"]))
    lines = [
        "| shape | verify us | of floor | " + " | ".join(f"vs {peer}" for peer in peers) + " |",
        "|---" * (len(peers) + 3) + "|",
    ]
    for row in summary:
        ratios = [f"{row['speedup'][p]:.1f}x" if p in row["speedup"] else "-" for p in peers]
        lines.append(
            f"| {row['shape']} | {row['ours_us']:.1f} | {row['floor_fraction']:.0%} | "
            + " | ".join(ratios)
            + " |"
        )
    return "\n".join(lines)


CASES = cases_for(bench_device(), quick=False)


@pytest.mark.parametrize("case", CASES, ids=[f"{case.shape}-{case.peer}" for case in CASES])
def test_verify(benchmark, case):
    run_in_pytest(benchmark, case)


if __name__ == "__main__":
    records = main("verify", "Verification sampling: verify against eager torch", cases_for)
    summary = summarize(records)
    print(format_summary(summary))
    # main() wrote the JSON (to --json, or its default); add the summary to the same file.
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "verify.json")
    path = parser.parse_known_args()[0].json
    payload = json.loads(path.read_text())
    payload["summary"] = summary
    path.write_text(json.dumps(payload, indent=2) + "\n")
