"""Medusa heads and `MedusaDrafter`: exactness and losslessness through `generate` with random
heads on a random tiny target, the public checkpoint layout, and the errors of a bad fit.

Exactness does not depend on the heads' quality (verification decides), so random heads prove it;
the tests also check that some drafts were accepted, so acceptance was really exercised.
"""

import json

import pytest
import torch
from test_generate import NEW_TOKENS, VOCAB, hf_greedy
from test_generate_sampling import P_MIN, chi_square_p, exact_pair_probs, sample_pairs
from tiny_models import repetitive_prompts, tiny_llama

from specdec_fast import MedusaDrafter, generate
from specdec_fast.heads.medusa import MedusaHeads, load_medusa_heads
from specdec_fast.trees import default_tree

HIDDEN = 48


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB)


def random_heads(hidden, vocab, num_heads=4, num_layers=1, shared=False, seed=0):
    """Heads with random (not zero) residual blocks, so every parameter matters."""
    torch.manual_seed(seed)
    heads = MedusaHeads(hidden, vocab, num_heads, num_layers, shared_lm_head=shared)
    for block_weight in (p for name, p in heads.named_parameters() if "linear.weight" in name):
        torch.nn.init.normal_(block_weight, std=0.2)
    return heads.eval()


TREES = {
    "default16": None,
    "choices": [[0], [0, 0], [1], [0, 1], [0, 0, 0], [2]],
    "vllm-string": "[(0,), (1,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]",
}


@pytest.mark.parametrize("lengths", [[13], [5, 17, 1, 30, 9]], ids=["batch1", "ragged5"])
@pytest.mark.parametrize("shared", [False, True], ids=["own-projection", "shared-lm-head"])
@pytest.mark.parametrize("tree", list(TREES))
def test_greedy_equals_hf_generate(target, lengths, shared, tree):
    prompts = repetitive_prompts(lengths, VOCAB, seed=len(lengths))
    drafter = MedusaDrafter(random_heads(HIDDEN, VOCAB, shared=shared), TREES[tree])
    out = generate(target, prompts, drafter=drafter, max_new_tokens=NEW_TOKENS)
    assert [s.tolist() for s in out.sequences] == hf_greedy(target, prompts)
    assert out.stats.drafted_tokens > 0


def test_heads_that_copy_the_target_get_repeats_accepted(target):
    """Shared-LM-head heads whose blocks are the identity propose, at depth 1, the target's own
    argmax at the root's parent, i.e. the root itself once the target chose it: a draft that is
    right exactly where the target repeats a token."""
    prompts = repetitive_prompts([7, 12, 5], VOCAB, seed=8)
    heads = MedusaHeads(HIDDEN, VOCAB, num_heads=2, num_layers=1, shared_lm_head=True)
    out = generate(target, prompts, drafter=MedusaDrafter(heads, [[0]]), max_new_tokens=30)
    expected = hf_greedy(target, prompts, 30)
    assert [s.tolist() for s in out.sequences] == expected
    repeats = [
        p
        for prompt, row in zip(prompts, expected, strict=True)
        for p in range(len(prompt), len(row) - 1)
        if row[p] == row[p + 1]
    ]
    assert repeats, "this check needs a target that repeats itself"
    assert out.stats.accepted_tokens > 0


SAMPLING_VOCAB = 16


@pytest.fixture(scope="module")
def sampling_target():
    return tiny_llama(vocab_size=SAMPLING_VOCAB, initializer_range=0.15, seed=2)


@pytest.mark.slow
@pytest.mark.parametrize("setting", [(1.0, 0, 1.0), (0.7, 5, 0.9)], ids=["t1", "t0.7-k5-p0.9"])
def test_sampling_follows_the_target(sampling_target, setting):
    """Chi-square tests of the first two sampled tokens (the method and tolerance of
    tests/test_generate_sampling.py: p >= 1e-3 over 3000 seeded draws)."""
    temperature, top_k, top_p = setting
    heads = random_heads(HIDDEN, SAMPLING_VOCAB, num_heads=2, seed=3)
    drafter = MedusaDrafter(heads, default_tree(7, max_depth=2))
    counts, stats = sample_pairs(sampling_target, drafter, temperature, top_k, top_p, seed=21)
    exact = exact_pair_probs(sampling_target, temperature, top_k, top_p)
    assert chi_square_p(counts.sum(1), exact.sum(1)) >= P_MIN
    assert chi_square_p(counts, exact) >= P_MIN
    assert stats.accepted_tokens > 0


@pytest.mark.parametrize("shared", [False, True], ids=["own-projection", "shared-lm-head"])
def test_save_and_load_round_trip(target, tmp_path, shared):
    heads = random_heads(HIDDEN, VOCAB, num_heads=3, num_layers=2, shared=shared)
    heads.save_pretrained(tmp_path)
    assert (tmp_path / "medusa_lm_head.safetensors").is_file()
    loaded = load_medusa_heads(tmp_path)
    assert loaded.config_dict() == heads.config_dict()
    for (name, expected), (_, got) in zip(
        heads.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(expected, got), name
    drafter = MedusaDrafter.from_pretrained(tmp_path, target)
    prompts = repetitive_prompts([9, 4], VOCAB, seed=4)
    out = generate(target, prompts, drafter=drafter, max_new_tokens=12)
    assert [s.tolist() for s in out.sequences] == hf_greedy(target, prompts, 12)


def write_public_medusa(folder, hidden, vocab, num_heads, num_layers, generator):
    """A checkpoint exactly as FasterDecoding/Medusa writes it: a pickled state dict in
    `medusa_lm_head.pt` and a config with only the Medusa fields."""
    state = {}
    for head in range(num_heads):
        for layer in range(num_layers):
            state[f"{head}.{layer}.linear.weight"] = torch.randn(
                hidden, hidden, generator=generator
            )
            state[f"{head}.{layer}.linear.bias"] = torch.randn(hidden, generator=generator)
        state[f"{head}.{num_layers}.weight"] = torch.randn(vocab, hidden, generator=generator)
    torch.save(state, folder / "medusa_lm_head.pt")
    config = {
        "medusa_num_heads": num_heads,
        "medusa_num_layers": num_layers,
        "base_model_name_or_path": "tiny",
    }
    (folder / "config.json").write_text(json.dumps(config))
    return state


def test_loads_the_public_layout(tmp_path):
    generator = torch.Generator().manual_seed(5)
    state = write_public_medusa(tmp_path, HIDDEN, VOCAB, 3, 1, generator)
    heads = load_medusa_heads(tmp_path)
    assert (heads.num_heads, heads.num_layers, heads.shared_lm_head) == (3, 1, False)
    hidden = torch.randn(2, HIDDEN, generator=generator)
    logits = heads(hidden)
    for head in range(3):
        weight, bias = state[f"{head}.0.linear.weight"], state[f"{head}.0.linear.bias"]
        block = hidden + torch.nn.functional.silu(hidden @ weight.T + bias)
        expected = block @ state[f"{head}.1.weight"].T
        torch.testing.assert_close(logits[:, head], expected, rtol=1e-5, atol=1e-4)


def test_bad_checkpoints_and_misfits_raise_clear_errors(target, tmp_path):
    generator = torch.Generator().manual_seed(6)
    state = write_public_medusa(tmp_path, HIDDEN, VOCAB, 2, 1, generator)
    del state["1.0.linear.bias"]
    state["1.0.extra"] = torch.zeros(1)
    torch.save(state, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match=r"missing keys \['1.0.linear.bias'\], unexpected keys"):
        load_medusa_heads(tmp_path)

    other = tmp_path / "wide"
    other.mkdir()
    write_public_medusa(other, HIDDEN + 8, VOCAB, 2, 1, generator)
    with pytest.raises(ValueError, match="hidden_size is 56, the target's is 48"):
        MedusaDrafter.from_pretrained(other, target)

    small_vocab = tmp_path / "vocab"
    small_vocab.mkdir()
    write_public_medusa(small_vocab, HIDDEN, VOCAB - 1, 2, 1, generator)
    with pytest.raises(ValueError, match="vocab_size is 95, the target's is 96"):
        MedusaDrafter.from_pretrained(small_vocab, target)

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no medusa_num_heads"):
        load_medusa_heads(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text('{"medusa_num_heads": 1, "medusa_num_layers": 1}')
    with pytest.raises(ValueError, match="no weights file"):
        load_medusa_heads(empty)
    with pytest.raises(ValueError, match="depth 3 needs that many heads"):
        MedusaDrafter(random_heads(HIDDEN, VOCAB, num_heads=2), [[0], [0, 0], [0, 0, 0]])
