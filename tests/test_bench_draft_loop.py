"""bench/bench_draft_loop.py's memory floor: the weight bytes that a step's matmuls read, counted
in an eager run (`WeightReads`), on bench_step's tiny shape. The verify forward reads every
matrix of the target once; EAGLE-3 at N = 8 its `fc` once and four forwards of its layer and LM
head; DFlash its layer, its `fc`, the layer's K and V projections again (the accepted context's
entries) and the target's LM head, or with a draft vocabulary that head's rows for it alone. The
script's 8B-shaped floors rest on these counts."""

import pytest
import torch
from bench_smoke import import_bench


@pytest.fixture
def bench(monkeypatch):
    return import_bench(monkeypatch, "bench_draft_loop")


def matrices(module: torch.nn.Module, prefix: str = "") -> int:
    """Elements of the module's matrices under `prefix`, embeddings left out (a lookup reads rows,
    not the matrix)."""
    return sum(
        p.numel()
        for name, p in module.named_parameters()
        if p.dim() == 2 and name.startswith(prefix) and "embed" not in name
    )


def test_weight_reads_count_each_matrix_a_step_streams(bench):
    from bench_generate import random_prompts
    from bench_overhead import Model
    from bench_step import TINY, build_model

    target = build_model(TINY, torch.device("cpu"))
    setup = Model("tiny", target, random_prompts(1, 48, TINY["vocab_size"]))
    heads = bench.heads_for(target)
    makers = bench.drafters(heads)
    size = 2  # bytes per bfloat16 weight
    eagle3, dflash = heads["eagle3"], heads["dflash"]
    attention = "layers.0.self_attn."
    kv = matrices(dflash, attention + "k_proj") + matrices(dflash, attention + "v_proj")
    head_forward = matrices(eagle3, "midlayer") + matrices(eagle3, "lm_head")
    lm_head = target.lm_head.weight
    narrow = TINY["vocab_size"] // 4
    expected = {
        "eagle3": matrices(eagle3, "fc") + 4 * head_forward,
        "dflash": matrices(dflash) + kv + lm_head.numel(),
        "dflash-32k": matrices(dflash) + kv + narrow * lm_head.shape[1],
    }
    assert heads["dflash-32k"].draft_ids.tolist() == list(range(narrow))
    assert eagle3.lm_head.weight.shape[0] == TINY["vocab_size"]  # under DRAFT_VOCAB: all of it
    for name, make in makers.items():
        drafter_mb, forward_mb = bench.weight_reads(setup, make, list(heads.values()))
        assert forward_mb * 1e6 == matrices(target) * size, name
        assert drafter_mb * 1e6 == expected[name] * size, name
