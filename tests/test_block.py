"""Block drafters (`BlockDrafter`, DFlash-style and PARD-style) with random models on random tiny
targets: greedy identity on ragged batches, the per-step block distributions against a
from-scratch recomputation (the training forward), sampling through `generate` against the
exact target, the public checkpoint layouts and the errors of a bad fit, and the training
command (loss, resume, export)."""

import dataclasses
import gc
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from drafter_wrappers import AttachedUnder
from safetensors.torch import save_file
from test_generate import hf_greedy
from test_generate_sampling import P_MIN, chi_square_p, exact_pair_probs, sample_pairs
from tiny_models import repetitive_prompts, tiny_llama
from torch.utils._python_dispatch import TorchDispatchMode

from specdec_fast import AdaptiveDrafter, BlockDrafter, CostModel, PardDraft, bundled, generate
from specdec_fast.drafters.base import root_only
from specdec_fast.drafters.block import load_block_model
from specdec_fast.drafters.dflash import _CAST_COPIES, cast_copy, draft_rows
from specdec_fast.drafters.pard import load_pard
from specdec_fast.guardrails import GuardedDrafter, GuardrailPolicy, RouteGuard
from specdec_fast.heads.block import DFlashHead, default_target_layers, load_dflash_head
from specdec_fast.loading import drafter_dtype, native_half_precision
from specdec_fast.train.block import (
    BlockOptions,
    dflash_block_outputs,
    export_block,
    pard_block_logits,
    train_block,
)
from specdec_fast.train.cli import build_parser
from specdec_fast.train.heads import target_pass
from specdec_fast.train.lm import LOG_NAME, TrainSettings

# Random drafters guess right often enough on a small vocabulary for acceptance to be exercised.
VOCAB = 32
MASK = 5
BLOCK = 6
SAMPLING_VOCAB = 16


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB, layers=4)


def dflash_head(target, seed=0, **overrides):
    torch.manual_seed(seed)
    args = dict(num_layers=2, block_size=BLOCK, mask_token_id=MASK, target_layers=[0, 3])
    return DFlashHead.for_target(target, **{**args, **overrides}).eval()


def pard_draft(vocab=VOCAB, seed=1):
    model = tiny_llama(vocab_size=vocab, hidden_size=32, seed=seed)
    model.set_attn_implementation("sdpa")
    return PardDraft(model, MASK, BLOCK)


MODELS = {"dflash": dflash_head, "pard": lambda target: pard_draft()}


@pytest.fixture(scope="module")
def ragged():
    prompts = repetitive_prompts([13, 5, 1, 30, 9, 2, 17, 8, 3, 21, 1, 11, 6, 14, 4, 25], VOCAB)
    return prompts


@pytest.fixture(scope="module")
def references(target, ragged):
    return hf_greedy(target, ragged, 32)


@pytest.mark.parametrize("batch", [1, 3, 16])
@pytest.mark.parametrize("tree", [("ddtree", 10), ("chain", BLOCK)], ids=["ddtree", "chain"])
@pytest.mark.parametrize("flavour", list(MODELS))
def test_greedy_equals_hf_generate(target, ragged, references, flavour, tree, batch):
    mode, nodes = tree
    drafter = BlockDrafter(MODELS[flavour](target), max_nodes=nodes, tree=mode)
    out = generate(target, ragged[:batch], drafter=drafter, max_new_tokens=32)
    assert [s.tolist() for s in out.sequences] == references[:batch]
    # Random drafters: over 16 rows some drafts are right, so acceptance is exercised.
    assert out.stats.accepted_tokens > 0 or batch < 16


@pytest.mark.parametrize("flavour", list(MODELS))
def test_sampled_trees_emit_what_plain_sampling_emits(target, flavour):
    """Best-first trees carry no draft probabilities: with randomness keyed by (row seed,
    position), sampled speculation emits exactly what plain sampling with the same seeds does."""
    prompts = repetitive_prompts([9, 5, 13], VOCAB, seed=4)
    options = dict(max_new_tokens=24, temperature=0.9, top_k=8, top_p=0.95, seed=[11, 12, 13])
    plain = generate(target, prompts, drafter=None, **options)
    drafter = BlockDrafter(MODELS[flavour](target), max_nodes=10)
    speculative = generate(target, prompts, drafter=drafter, **options)
    assert [s.tolist() for s in speculative.sequences] == [s.tolist() for s in plain.sequences]
    assert speculative.stats.accepted_tokens > 0


class RecordingDrafter(BlockDrafter):
    """Keeps, per step and row, the row's tokens so far and its block distributions (every row of
    a ragged batch: each reads its own span of the head's cache)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps, self.root_positions = [], []
        self.flavour.shape = RecordingShape(self.flavour.shape, self)

    def propose(self, state):
        self.tokens = state.tokens
        return super().propose(state)


class RecordingShape:
    """A `BlockShape` that hands its drafter each step's block logits, per row, and the roots'
    positions that the flavour's step gave, per step."""

    def __init__(self, shape, drafter):
        self.shape, self.drafter = shape, drafter

    def __getattr__(self, name):
        return getattr(self.shape, name)

    def propose(self, logits, roots, root_positions, *sampling):
        rows = zip(self.drafter.tokens, logits, strict=True)
        self.drafter.steps.extend((list(tokens), row.clone()) for tokens, row in rows)
        lengths = [len(tokens) - 1 for tokens in self.drafter.tokens]
        self.drafter.root_positions.append((root_positions.tolist(), lengths))
        return self.shape.propose(logits, roots, root_positions, *sampling)


def from_scratch(model, target, tokens):
    """The block distributions `[D, V]` after `tokens` (the last is the root), by the training
    forward over the whole sequence without a cache."""
    root = len(tokens) - 1
    rows, anchors = torch.tensor([tokens]), torch.tensor([[root]])
    with torch.no_grad():
        if isinstance(model, DFlashHead):
            features, _ = target_pass(target, rows, model.hidden_layers)
            outputs = dflash_block_outputs(model, target, features, rows, anchors)
            return target.get_output_embeddings()(outputs[0, 0, 1:])
        real, masks = pard_block_logits(model.model, MASK, BLOCK, rows, anchors)
        return torch.cat([real[0, root : root + 1], masks[0, 0]])


@pytest.mark.parametrize("flavour", list(MODELS))
def test_block_distributions_match_the_training_forward(target, flavour):
    """Every step's distributions equal the training forward's over the whole sequence: the
    drafter's caches follow the accepted paths, and training computes what inference does."""
    model = MODELS[flavour](target)
    drafter = RecordingDrafter(model, max_nodes=8)
    prompts = repetitive_prompts([11, 6], VOCAB, seed=9)
    out = generate(target, prompts, drafter=drafter, max_new_tokens=24)
    assert [s.tolist() for s in out.sequences] == hf_greedy(target, prompts, 24)
    assert out.stats.accepted_tokens > 0  # the caches followed accepted paths, not only roots
    positions = BLOCK - 1 if flavour == "dflash" else BLOCK
    for tokens, logits in drafter.steps:
        assert logits.shape == (positions, VOCAB)
        torch.testing.assert_close(
            logits, from_scratch(model, target, tokens), rtol=1e-4, atol=1e-4
        )


class SkippingDrafter(RecordingDrafter):
    """Drafts no block every other step (a root-only proposal, as a wrapper falling back for a
    step would) and still follows every step's accepted path."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def propose(self, state):
        self.calls += 1
        return root_only(state) if self.calls % 2 == 0 else super().propose(state)


def test_dflash_context_follows_steps_that_draft_no_block(target):
    """The DFlash flavour writes a step's context entries with the next step's block; a step
    that drafts no block has them written on their own, so the blocks after it still see every
    verified token (the distributions equal the training forward's)."""
    drafter = SkippingDrafter(dflash_head(target), max_nodes=8)
    prompts = repetitive_prompts([11, 6], VOCAB, seed=9)
    out = generate(target, prompts, drafter=drafter, max_new_tokens=24)
    assert [s.tolist() for s in out.sequences] == hf_greedy(target, prompts, 24)
    assert out.stats.accepted_tokens > 0 and len(drafter.steps) >= 3
    for tokens, logits in drafter.steps:
        torch.testing.assert_close(
            logits, from_scratch(drafter.model, target, tokens), rtol=1e-4, atol=1e-4
        )


@pytest.mark.parametrize("flavour", list(MODELS))
def test_sampled_chains_draw_at_the_roots_positions(target, ragged, flavour):
    """A sampled chain's draws are keyed by its roots' positions, which the flavours' steps take
    from their caches' lengths on the device (so chains read ahead): at every step, each row's
    count of tokens before its root, on ragged rows."""
    drafter = RecordingDrafter(MODELS[flavour](target), max_nodes=5, tree="chain")
    prompts = ragged[:4]
    generate(
        target, prompts, drafter=drafter, max_new_tokens=24, temperature=0.9, seed=[1, 2, 3, 4]
    )
    assert len(drafter.root_positions) >= 4
    for step, (positions, lengths) in enumerate(drafter.root_positions):
        assert positions == lengths, step


@pytest.fixture(scope="module")
def sampling_target():
    return tiny_llama(vocab_size=SAMPLING_VOCAB, initializer_range=0.15, seed=2, layers=4)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flavour", "tree", "setting"),
    [
        ("dflash", "chain", (1.0, 0, 1.0)),
        ("dflash", "ddtree", (0.7, 5, 0.9)),
        ("dflash-vocab", "chain", (0.7, 5, 0.9)),
        ("pard", "chain", (0.7, 5, 0.9)),
        ("pard", "ddtree", (1.0, 0, 1.0)),
    ],
)
def test_sampling_follows_the_target(sampling_target, flavour, tree, setting):
    """Chi-square tests of the first two sampled tokens (the method and tolerance of
    tests/test_generate_sampling.py): sampled chains carry their draft probabilities (a draft
    vocabulary's spread over the target's ids), trees are deterministic proposals."""
    temperature, top_k, top_p = setting
    if flavour.startswith("dflash"):
        model = dflash_head(sampling_target, seed=4, block_size=3)
        if flavour == "dflash-vocab":  # ten of the sixteen ids, not in id order
            model.set_draft_vocab(torch.randperm(SAMPLING_VOCAB)[:10])
    else:
        model = PardDraft(pard_draft(SAMPLING_VOCAB, seed=5).model, MASK, 3)
    drafter = BlockDrafter(model, max_nodes=3, tree=tree)
    counts, stats = sample_pairs(sampling_target, drafter, temperature, top_k, top_p, seed=41)
    exact = exact_pair_probs(sampling_target, temperature, top_k, top_p)
    assert chi_square_p(counts.sum(1), exact.sum(1)) >= P_MIN
    assert chi_square_p(counts, exact) >= P_MIN
    assert stats.accepted_tokens > 0


@pytest.mark.slow
def test_compiled_dflash_steps_match_eager_and_compile_once(target, ragged, references):
    """Attached under a compile choice of on (the target eager: compiling it would take the
    test from 15 s to 2 min), the DFlash step (the pending context entries and the block in
    one forward) runs compiled: the same output and the same accepted drafts as eagerly (the
    compiled block gives the same trees), reported in `stats.compiled`. Later calls, with new
    drafters around other heads of the same shape (other weights), other batch sizes and other
    lengths (one- and two-token prompts: no context entry to take yet, padded to the same
    width), compile nothing and still draft as those heads do eagerly. (A one-layer head: no
    other test compiles one.)"""
    calls = [(ragged[:3], 0), (ragged[5:7], 1), ([ragged[2], ragged[5]], 2)]
    assert [len(prompt) for prompt in calls[2][0]] == [1, 2]

    def run(prompts, seed, compiled):
        # Five nodes: the tree's best-first rounds unroll in the graph, each round the same
        # code (ten nodes took the test's cold compile from 41 to 71 s).
        drafter = BlockDrafter(dflash_head(target, seed, num_layers=1), max_nodes=5)
        drafter = AttachedUnder(drafter, compile=True) if compiled else drafter
        return generate(target, prompts, drafter=drafter, max_new_tokens=32, compile=False)

    eager = [run(prompts, seed, False).stats for prompts, seed in calls]
    for index, ((prompts, seed), want) in enumerate(zip(calls, eager, strict=True)):
        out = run(prompts, seed, True)
        assert [s.tolist() for s in out.sequences] == [references[ragged.index(p)] for p in prompts]
        assert [s.accepted for s in out.stats.sequences] == [s.accepted for s in want.sequences]
        kinds = {label.split()[1] for label in out.stats.compiled if label.startswith("dflash")}
        assert kinds == ({"block"} if index == 0 else set()), out.stats.compiled


@pytest.mark.parametrize("flavour", list(MODELS))
def test_adaptive_and_guarded_block_drafters_stay_exact(target, ragged, references, flavour):
    """Under the adaptive wrapper (budgets changing step to step, trees trimmed to their best
    nodes) and guardrails, the drafters' caches follow and the output stays exact."""
    cheap = CostModel()
    for batch in range(1, 5):
        for nodes in range(1, 11):
            cheap.observe_verify(batch, nodes, 1.0)
    adaptive = AdaptiveDrafter(
        BlockDrafter(MODELS[flavour](target), max_nodes=10), cheap, explore_every=2
    )
    adaptive.acceptance.add(10, [[0, 1, 2, 3] + [-1] * 6] * 4)
    guarded = GuardedDrafter(adaptive, RouteGuard("r", GuardrailPolicy(min_acceptance_rate=0.0)))
    out = generate(target, ragged[:4], drafter=guarded, max_new_tokens=32)
    assert [s.tolist() for s in out.sequences] == references[:4]
    assert len(set(adaptive.chosen)) >= 2 and not guarded.events


# --- checkpoints -------------------------------------------------------------------------------


def public_dflash_state(config, generator):
    """The keys and shapes of z-lab/dflash `DFlashDraftModel` checkpoints, written out by hand as
    an independent statement of the layout."""
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    # One fused feature per target layer; by default as many target layers as draft layers.
    layers = config["dflash_config"].get("target_layer_ids") or range(config["num_hidden_layers"])
    shapes = {
        "fc.weight": (hidden, len(layers) * hidden),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    for i in range(config["num_hidden_layers"]):
        shapes.update(
            {
                f"layers.{i}.input_layernorm.weight": (hidden,),
                f"layers.{i}.post_attention_layernorm.weight": (hidden,),
                f"layers.{i}.self_attn.q_proj.weight": (heads * head_dim, hidden),
                f"layers.{i}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                f"layers.{i}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                f"layers.{i}.self_attn.o_proj.weight": (hidden, heads * head_dim),
                f"layers.{i}.self_attn.q_norm.weight": (head_dim,),
                f"layers.{i}.self_attn.k_norm.weight": (head_dim,),
                f"layers.{i}.mlp.gate_proj.weight": (inter, hidden),
                f"layers.{i}.mlp.up_proj.weight": (inter, hidden),
                f"layers.{i}.mlp.down_proj.weight": (hidden, inter),
            }
        )
    return {key: torch.randn(shape, generator=generator) * 0.2 for key, shape in shapes.items()}


def write_public_dflash(folder, target, generator, **config_changes):
    """A folder laid out as the published DFlash checkpoints (Qwen3 config, `dflash_config`)."""
    base = target.config
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "block_size": BLOCK,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 2]},
        "dtype": "bfloat16",
        "head_dim": base.head_dim,
        "hidden_act": "silu",
        "hidden_size": base.hidden_size,
        "intermediate_size": 64,
        "layer_types": ["full_attention", "full_attention"],
        "max_position_embeddings": 512,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_target_layers": base.num_hidden_layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": base.vocab_size,
    }
    config.update(config_changes)
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    state = public_dflash_state(config, generator)
    save_file(state, str(folder / "model.safetensors"))
    return state


def test_dflash_loads_the_public_layout(target, tmp_path):
    state = write_public_dflash(tmp_path, target, torch.Generator().manual_seed(3))
    head = load_dflash_head(tmp_path, target)
    assert head.block_size == BLOCK and head.mask_token_id == MASK
    assert head.target_layers == (1, 2) and head.hidden_layers == (1, 2)
    torch.testing.assert_close(head.fc.weight, state["fc.weight"])
    drafter = BlockDrafter.from_pretrained(tmp_path, target, max_nodes=8)
    prompts = repetitive_prompts([10, 3], VOCAB, seed=12)
    out = generate(target, prompts, drafter=drafter, max_new_tokens=16)
    assert [s.tolist() for s in out.sequences] == hf_greedy(target, prompts, 16)


def test_drafter_dtype_follows_the_checkpoint_where_the_hardware_has_it(monkeypatch):
    """A head stored in a 16-bit dtype computes in it where the device has that math (on the
    CPU: AVX512-BF16 or AMX for bfloat16, AMX-FP16 for float16), else in the target's dtype;
    a float32 checkpoint always follows the target."""
    cpu, fp32, bf16, fp16 = torch.device("cpu"), torch.float32, torch.bfloat16, torch.float16
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda: False, raising=False)
    assert not native_half_precision(cpu, bf16) and not native_half_precision(cpu, fp32)
    assert drafter_dtype(cpu, bf16, fp32) == fp32
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert native_half_precision(cpu, bf16) and not native_half_precision(cpu, fp16)
    assert drafter_dtype(cpu, bf16, fp32) == bf16
    assert drafter_dtype(cpu, fp16, fp32) == fp32  # AMX tiles alone do not do float16
    assert drafter_dtype(cpu, fp32, bf16) == bf16  # a float32 checkpoint follows the target
    assert not native_half_precision(torch.device("meta"), bf16)


@pytest.mark.parametrize("native", [True, False], ids=["bf16-cpu", "plain-cpu"])
def test_bfloat16_heads_on_a_float32_target_load_so_and_stay_exact(
    target, ragged, references, tmp_path, monkeypatch, native
):
    """A bfloat16 checkpoint on a float32 target computes in bfloat16 where the CPU has it
    (embeddings, features and the target's LM head cast to it): greedy output is still the
    target's own on a ragged batch, and the blocks' distributions stay within bfloat16's
    rounding of the float32 head's. `dtype=` overrides the default."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    head = dflash_head(target, seed=5)
    head.to(torch.bfloat16).save_pretrained(tmp_path)
    expected = torch.bfloat16 if native else torch.float32
    loaded = load_block_model(tmp_path, target)
    assert loaded.fc.weight.dtype == expected
    assert load_block_model(tmp_path, target, torch.float32).fc.weight.dtype == torch.float32
    drafter = RecordingDrafter(loaded, max_nodes=10)
    out = generate(target, ragged, drafter=drafter, max_new_tokens=32)
    assert [s.tolist() for s in out.sequences] == references
    assert out.stats.accepted_tokens > 0
    reference = load_block_model(tmp_path, target, torch.float32)
    for tokens, logits in drafter.steps[:8]:
        exact = from_scratch(reference, target, tokens)
        # bfloat16 keeps 8 bits of mantissa: two layers and the LM head are off by about 0.03
        # on logits of magnitude 4 here; float32 agrees to rounding.
        error = float((logits - exact).abs().max())
        assert (0 < error < 0.08) if native else error < 1e-4


class _Products(TorchDispatchMode):
    """The matrix products dispatched while it is on: (operator, its operands' shapes)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            shapes = [tuple(arg.shape) for arg in args if isinstance(arg, torch.Tensor)]
            self.calls.append((func.overloadpacket.__name__, shapes))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dflash_blocks_meet_the_lm_head_as_one_matrix_product(target, dtype):
    """The block's logits are one 2-D product with the target's LM head. A slice of the 3-D
    outputs took `matmul`'s batched path (`bmm` over the head expanded to a batch of one),
    whose CPU kernel copied the whole head transposed at every step: on the real target 90 ms
    a step at batch 1 on one thread, against 11 ms."""
    head = dflash_head(target, seed=2).to(dtype)
    vocab, hidden = target.get_output_embeddings().weight.shape
    products = _Products()
    with products:
        drafter = BlockDrafter(head, 8)
        generate(target, [[3, 1, 4, 1, 5]], drafter=drafter, max_new_tokens=6, compile=False)
    blocks = [
        shapes
        for name, shapes in products.calls
        if name != "bmm" and shapes[-2:] == [(BLOCK - 1, hidden), (hidden, vocab)]
    ]
    batched = [call for call in products.calls if call[0] == "bmm" and call[1][-1][-1] == vocab]
    assert blocks and not batched, products.calls


def test_target_weights_are_cast_once_per_dtype_and_version():
    """A bfloat16 head's copy of a float32 target's LM head is made once and shared by every
    drafter attached to it, remade after an in-place change, and dropped with the weight."""
    weight = torch.nn.Parameter(torch.randn(6, 4))
    first = cast_copy(weight, torch.bfloat16)
    assert first.dtype == torch.bfloat16 and cast_copy(weight, torch.bfloat16) is first
    assert cast_copy(weight, torch.float32).data_ptr() == weight.data_ptr()  # no copy
    with torch.no_grad():
        weight.mul_(2)
    again = cast_copy(weight, torch.bfloat16)
    assert again is not first and torch.equal(again, weight.detach().bfloat16())
    target = tiny_llama(vocab_size=VOCAB, layers=4)
    heads = [dflash_head(target, seed).to(torch.bfloat16) for seed in (1, 2)]
    drafters = [BlockDrafter(head, max_nodes=8) for head in heads]
    for drafter in drafters:
        drafter.attach(target, 64)
    copies = [drafter.flavour._lm_weight for drafter in drafters]
    assert copies[0] is copies[1] and copies[0].dtype == torch.bfloat16
    held = len(_CAST_COPIES)
    del weight, first, again
    gc.collect()
    assert len(_CAST_COPIES) == held - 1


def shard_weights(folder: Path, state: dict, first: int) -> None:
    """Replace `folder`'s model.safetensors with two shards of `state` (the first `first` keys
    in sorted order, then the rest) and their index, as a published sharded checkpoint."""
    (folder / "model.safetensors").unlink()
    keys = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": keys[:first],
        "model-00002-of-00002.safetensors": keys[first:],
    }
    for name, names in shards.items():
        save_file({key: state[key] for key in names}, str(folder / name))
    weight_map = {key: name for name, names in shards.items() for key in names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_dflash_defaults_and_sharded_weights(target, tmp_path):
    """Without `target_layer_ids` the reference's default layers are read; the last target
    layer's entry is the final normed state; a sharded safetensors checkpoint loads."""
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B-DFlash-b16's layers
    assert default_target_layers(4, 1) == [2]
    generator = torch.Generator().manual_seed(4)
    state = write_public_dflash(
        tmp_path,
        target,
        generator,
        dflash_config={"mask_token_id": MASK},
        num_hidden_layers=1,
        layer_types=["full_attention"],
    )
    shard_weights(tmp_path, state, 3)
    head = load_dflash_head(tmp_path, target)
    assert head.target_layers == (2,)
    last = dflash_head(target, target_layers=[1, 3])
    assert last.hidden_layers == (1, -1)


def test_dflash_save_and_load_round_trip(target, tmp_path):
    head = dflash_head(target, seed=2)
    head.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {
        "block_size": BLOCK,
        "mask_token_id": MASK,
        "target_layer_ids": [0, 3],
    }
    loaded = load_block_model(tmp_path, target)
    assert isinstance(loaded, DFlashHead)
    for (name, expected), (_, got) in zip(
        head.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(expected, got), name


class ProposalRecorder(BlockDrafter):
    """Keeps every proposal's tokens."""

    def propose(self, state):
        proposal = super().propose(state)
        self.proposed = [*getattr(self, "proposed", []), proposal.tokens.clone()]
        return proposal


def per_row_steps(out):
    return [[s.steps, s.drafted, s.accepted] for s in out.stats.sequences]


@pytest.mark.parametrize("tree", [("ddtree", 10), ("chain", BLOCK)], ids=["ddtree", "chain"])
def test_a_draft_vocabulary_drafts_from_its_rows_only(target, ragged, references, tree):
    """A head with a draft vocabulary meets only its rows of the target's LM head: over every id
    in another order it drafts what the head without one drafts, step for step; over a third of
    the ids it drafts those alone, and stays exact."""
    mode, nodes = tree
    generator = torch.Generator().manual_seed(7)

    def run(ids):
        head = dflash_head(target, seed=3)
        head.set_draft_vocab(ids)
        drafter = ProposalRecorder(head, max_nodes=nodes, tree=mode)
        out = generate(target, ragged, drafter=drafter, max_new_tokens=32)
        assert [s.tolist() for s in out.sequences] == references
        rows = drafter.flavour._lm_weight.shape[0]
        return out, rows, torch.cat([t[:, 1:].flatten() for t in drafter.proposed])

    whole, rows, _ = run(None)
    assert rows == VOCAB and whole.stats.accepted_tokens > 0
    permuted, rows, _ = run(torch.randperm(VOCAB, generator=generator))
    assert rows == VOCAB and per_row_steps(permuted) == per_row_steps(whole)
    third = torch.randperm(VOCAB, generator=generator)[: VOCAB // 3]
    subset, rows, drafted = run(third)
    assert rows == len(third) and subset.stats.accepted_tokens > 0
    assert set(drafted.tolist()) <= set(third.tolist())


def test_draft_rows_follow_the_vocabulary_and_the_weights(target):
    """A head's LM-head rows are made once, and anew for another vocabulary, an in-place change
    of the weights, other weights or another dtype."""
    head = dflash_head(target, seed=5)
    head.set_draft_vocab([4, 2, 9])
    lm_head = torch.nn.Linear(head.config.hidden_size, VOCAB)
    ids, rows, bias = draft_rows(head, lm_head, torch.float32)
    assert ids.tolist() == [4, 2, 9] and torch.equal(rows, lm_head.weight[[4, 2, 9]])
    assert torch.equal(bias, lm_head.bias[[4, 2, 9]])
    assert draft_rows(head, lm_head, torch.float32)[1] is rows
    head.set_draft_vocab([1, 3])
    ids, rows, _ = draft_rows(head, lm_head, torch.float32)
    assert ids.tolist() == [1, 3] and torch.equal(rows, lm_head.weight[[1, 3]])
    with torch.no_grad():
        lm_head.weight.mul_(2)
    again = draft_rows(head, lm_head, torch.float32)[1]
    assert again is not rows and torch.equal(again, lm_head.weight[[1, 3]])
    other = torch.nn.Linear(head.config.hidden_size, VOCAB, bias=False)
    _, rows, bias = draft_rows(head, other, torch.float32)
    assert torch.equal(rows, other.weight[[1, 3]]) and bias is None
    assert draft_rows(head, other, torch.bfloat16)[1].dtype == torch.bfloat16


def test_draft_vocabularies_save_load_and_refuse_bad_ids(target, tmp_path):
    head = dflash_head(target, seed=2)
    head.set_draft_vocab([9, 2, 30, 4])
    head.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["draft_vocab_size"] == 4
    loaded = load_dflash_head(tmp_path, target)
    assert loaded.draft_ids.tolist() == [9, 2, 30, 4]
    loaded.set_draft_vocab(None)
    assert loaded.draft_ids is None and "d2t" not in loaded.state_dict()
    loaded.save_pretrained(tmp_path / "whole")
    assert "draft_vocab_size" not in json.loads((tmp_path / "whole" / "config.json").read_text())
    for ids, message in [
        ([3, 3], "expected distinct target ids"),
        ([], "expected distinct target ids"),
        ([1, VOCAB], f"ids outside the vocabulary's {VOCAB}"),
    ]:
        with pytest.raises(ValueError, match=message):
            head.set_draft_vocab(ids)
    state = dict(head.state_dict())
    state["d2t"] = torch.tensor([0, 0, 0, VOCAB])  # the last draft id maps to VOCAB + 3
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"d2t maps draft ids outside the target's {VOCAB}"):
        load_dflash_head(tmp_path, target)
    (tmp_path / "config.json").write_text(json.dumps({**config, "draft_vocab_size": VOCAB + 1}))
    with pytest.raises(ValueError, match=rf"draft_vocab_size must be in \[1, {VOCAB}\]"):
        load_dflash_head(tmp_path, target)
    (tmp_path / "config.json").write_text(json.dumps({**config, "draft_vocab_size": 5}))
    with pytest.raises(ValueError, match=r"d2t: expected shape \(5,\)"):
        load_dflash_head(tmp_path, target)


def test_pard_save_and_load_round_trip(target, tmp_path):
    draft = pard_draft()
    draft.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["pard_token"], config["spd_type"], config["block_size"]) == (MASK, "pard", BLOCK)
    loaded = load_block_model(tmp_path, target)
    assert isinstance(loaded, PardDraft)
    assert (loaded.mask_token_id, loaded.block_size) == (MASK, BLOCK)
    for (name, expected), (_, got) in zip(
        draft.model.state_dict().items(), loaded.model.state_dict().items(), strict=True
    ):
        assert torch.equal(expected, got), name
    # The published configs carry no block size (it is a run-time choice): PARD's default.
    del config["block_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_pard(tmp_path, target).block_size == 8


@pytest.mark.parametrize("flavour", list(MODELS))
def test_the_depth_scale_comes_from_the_checkpoint_and_stays_exact(
    target, ragged, references, flavour, tmp_path
):
    model = MODELS[flavour](target)
    assert model.depth_scale == 1.0 and BlockDrafter(model).depth_scale == 1.0
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "ddtree_depth_scale": 0.2}))
    loaded = load_block_model(tmp_path, target)
    assert loaded.depth_scale == 0.2
    drafter = BlockDrafter(loaded, max_nodes=10)
    assert drafter.depth_scale == 0.2 and "depth_scale=0.2" in repr(drafter)
    assert BlockDrafter(loaded, depth_scale=0.5).depth_scale == 0.5
    out = generate(target, ragged[:3], drafter=drafter, max_new_tokens=32)
    assert [s.tolist() for s in out.sequences] == references[:3]
    if flavour == "pard":  # the scale survives PARD's own save
        loaded.save_pretrained(tmp_path / "again")
        assert load_block_model(tmp_path / "again", target).depth_scale == 0.2
    with pytest.raises(ValueError, match="depth_scale must be a finite number > 0"):
        BlockDrafter(loaded, depth_scale=0.0)
    (tmp_path / "config.json").write_text(json.dumps({**config, "ddtree_depth_scale": None}))
    assert load_block_model(tmp_path, target).depth_scale == 1.0
    (tmp_path / "config.json").write_text(json.dumps({**config, "ddtree_depth_scale": -1}))
    with pytest.raises(ValueError, match=r"config\.json: depth_scale must be a finite number"):
        load_block_model(tmp_path, target)


MISFITS = {
    "wide": ({"hidden_size": 64}, "hidden_size is 64, the target's is 48"),
    "vocab": ({"vocab_size": VOCAB + 4}, "vocab_size is 36, the target's is 32"),
    "layers": ({"num_target_layers": 36}, "num_target_layers is 36, the target's is 4"),
    "layer-ids": (
        {"dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 7]}},
        r"target layers \[7\] do not exist in a 4-layer target",
    ),
    "mask": (
        {"dflash_config": {"mask_token_id": VOCAB, "target_layer_ids": [1, 2]}},
        "mask_token_id 32 is outside the target's 32 token ids",
    ),
    "dflash2": (
        {"architectures": ["DFlash2DraftModel"]},
        r"architectures \['DFlash2DraftModel'\] are not supported",
    ),
    "inconsistent": ({"layer_types": ["full_attention"]}, "(?s)config.json: .*layer_types"),
}


@pytest.mark.parametrize("misfit", list(MISFITS))
def test_dflash_heads_that_do_not_fit_raise_clear_errors(target, tmp_path, misfit):
    changes, message = MISFITS[misfit]
    write_public_dflash(tmp_path, target, torch.Generator().manual_seed(13), **changes)
    with pytest.raises(ValueError, match=message):
        load_dflash_head(tmp_path, target)


def test_bad_checkpoints_and_misfits_raise_clear_errors(target, tmp_path):
    generator = torch.Generator().manual_seed(13)

    folder = tmp_path / "missing"
    state = write_public_dflash(folder, target, generator)
    del state["layers.1.mlp.up_proj.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing keys \['layers.1.mlp.up_proj.weight'\]"):
        load_dflash_head(folder, target)

    folder = tmp_path / "pickle"
    write_public_dflash(folder, target, generator)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="no model.safetensors nor model.safetensors.index.json"):
        load_dflash_head(folder, target)

    folder = tmp_path / "pard-vocab"
    pard_draft(vocab=VOCAB + 1).save_pretrained(folder)
    with pytest.raises(ValueError, match="vocabularies differ in size: draft 33, target 32"):
        load_pard(folder, target)

    folder = tmp_path / "pard-pickle"
    pard_draft().save_pretrained(folder)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="no model.safetensors nor model.safetensors.index.json"):
        load_pard(folder, target)

    folder = tmp_path / "pard"
    pard_draft().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    del config["pard_token"], config["spd_type"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="neither a DFlash head's .* nor a PARD model's"):
        load_block_model(folder, target)
    with pytest.raises(ValueError, match="config.json has none of pard_token, ptd_token_id"):
        load_pard(folder, target)

    with pytest.raises(ValueError, match="a chain of 6 tokens is longer than the block's 5"):
        BlockDrafter(dflash_head(target), max_nodes=7, tree="chain")
    with pytest.raises(ValueError, match="tree: expected one of"):
        BlockDrafter(dflash_head(target), tree="beam")
    with pytest.raises(ValueError, match="model: expected a DFlashHead or a PardDraft"):
        BlockDrafter(target)
    with pytest.raises(ValueError, match=r"mask_token_id: expected a token id in \[0, 32\)"):
        PardDraft(pard_draft().model, VOCAB)
    other = tiny_llama(vocab_size=VOCAB + 1, layers=4)
    with pytest.raises(ValueError, match="vocab_size is 32, the target's is 33"):
        generate(other, [[1, 2, 3]], drafter=BlockDrafter(dflash_head(target)), max_new_tokens=2)


# --- training ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stream():
    return np.array(sum(repetitive_prompts([40] * 100, VOCAB, seed=3), []), dtype=np.int32)


@pytest.fixture(scope="module")
def pard_init(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pard-init")
    pard_draft().model.save_pretrained(folder)
    return str(folder)


def options(flavour, pard_init):
    return BlockOptions(
        flavour,
        block_size=BLOCK,
        num_layers=1,
        target_layers=[1, 3],
        init=pard_init,
        anchors=8,
        mask_token_id=MASK,
    )


def settings(steps):
    return TrainSettings(
        steps=steps, batch_size=2, seq_len=32, lr=1e-2, warmup_steps=2, log_every=5
    )


@pytest.mark.parametrize("flavour", ["dflash", "pard"])
def test_training_lowers_the_loss_and_resumes_exactly(target, stream, pard_init, tmp_path, flavour):
    run = options(flavour, pard_init)
    whole, _ = train_block(run, settings(20), target, stream, tmp_path / "whole")
    lines = (tmp_path / "whole" / LOG_NAME).read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in lines]
    assert len(losses) == 4 and losses[-1] < 0.95 * losses[0]
    train_block(run, settings(20), target, stream, tmp_path / "split", stop_at=9)
    resumed, steps = train_block(run, settings(20), target, stream, tmp_path / "split", resume=True)
    assert steps == 20
    for (name, expected), (_, got) in zip(
        whole.state_dict().items(), resumed.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match="this run asks for"):
        train_block(run, settings(21), target, stream, tmp_path / "split", resume=True)


@pytest.mark.parametrize("flavour", ["dflash", "pard"])
def test_exported_drafters_load_and_are_exact(target, stream, pard_init, tmp_path, flavour):
    """Exported in their layouts, a DFlash head with a draft vocabulary (the command's
    `--draft-vocab`); PARD models have none."""
    run = options(flavour, pard_init)
    module, _ = train_block(run, settings(2), target, stream, tmp_path / "run")
    draft_ids = [7, 3, 11, 0, 5, 9] if flavour == "dflash" else None
    export_block(run, module, bundled.path("tiny-code"), tmp_path / "out", draft_ids)
    drafter = BlockDrafter.from_pretrained(tmp_path / "out", target, max_nodes=8)
    assert drafter.flavour_name == flavour and drafter.model.block_size == BLOCK
    if flavour == "dflash":
        assert drafter.model.draft_ids.tolist() == draft_ids
        assert module.draft_ids is None  # the trained module is left as it was
    else:
        with pytest.raises(ValueError, match="only DFlash heads draft from a draft vocabulary"):
            export_block(run, module, bundled.path("tiny-code"), tmp_path / "again", [1, 2])
    prompts = repetitive_prompts([12, 5], VOCAB, seed=2)
    out = generate(target, prompts, drafter=drafter, max_new_tokens=10)
    assert [s.tolist() for s in out.sequences] == hf_greedy(target, prompts, 10)


def test_dflash_heads_train_with_their_own_kv_heads(target, stream, pard_init, tmp_path):
    """`num_kv_heads` gives the DFlash head KV heads of its own (4 over the target's 2): the
    exported head says so, loads, and drafts exactly; a count that does not divide the
    attention heads, or below 1, is refused before training."""
    run = dataclasses.replace(options("dflash", pard_init), num_kv_heads=4)
    module, _ = train_block(run, settings(2), target, stream, tmp_path / "run")
    assert module.config.num_key_value_heads == 4
    assert module.layers[0].self_attn.k_proj.out_features == 4 * module.config.head_dim
    export_block(run, module, bundled.path("tiny-code"), tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_key_value_heads"] == 4
    drafter = BlockDrafter.from_pretrained(tmp_path / "out", target, max_nodes=8)
    prompts = repetitive_prompts([12, 5], VOCAB, seed=2)
    out = generate(target, prompts, drafter=drafter, max_new_tokens=10)
    assert [s.tolist() for s in out.sequences] == hf_greedy(target, prompts, 10)
    bad = dataclasses.replace(run, num_kv_heads=3)
    with pytest.raises(ValueError, match="does not divide the target's 4 attention heads"):
        train_block(bad, settings(2), target, stream, tmp_path / "bad")
    with pytest.raises(ValueError, match="num_kv_heads must be >= 1"):
        dataclasses.replace(run, num_kv_heads=0)
    args = build_parser().parse_args(
        ["block", "--flavour", "dflash", "--run-dir", "r", "--steps", "3", "--num-kv-heads", "4"]
    )
    assert args.num_kv_heads == 4


def test_the_command_line_and_its_defaults():
    parser = build_parser()
    args = parser.parse_args(["block", "--flavour", "dflash", "--run-dir", "r", "--steps", "3"])
    assert args.target == "tiny-code" and args.lr is None and args.num_layers == 2
    assert args.draft_vocab == 0  # the whole vocabulary
    flavour_defaults = {f: BlockOptions(f).block_size for f in ("dflash", "pard")}
    assert flavour_defaults == {"dflash": 16, "pard": 8}
    args = parser.parse_args(
        ["block", "--flavour", "pard", "--run-dir", "r", "--steps", "3", "--target-layers", "1,3"]
    )
    assert args.target_layers == [1, 3] and args.init == "tiny-code-draft"
    with pytest.raises(SystemExit):
        parser.parse_args(["block", "--flavour", "medusa", "--run-dir", "r", "--steps", "3"])
    with pytest.raises(ValueError, match="flavour: expected one of"):
        BlockOptions("medusa")


# --- the bundled block drafters (shipped once trained for the bundled target) --------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-code-dflash", "tiny-code-pard"])
def test_bundled_block_drafters_keep_their_recorded_acceptance(name):
    """Exact, and within a BLAS-sized margin of the acceptance recorded at export on the same
    held-out prompts: a damaged, swapped or retrained-badly checkpoint fails."""
    if name not in bundled.available() or "tiny-code" not in bundled.available():
        pytest.skip(f"{name} is not installed")
    from specdec_fast.loading import load_model
    from specdec_fast.train.block import engine_acceptance, eval_prompts
    from specdec_fast.train.export import read_info

    recorded = read_info(bundled.path(name))["engine"]
    target = load_model("tiny-code", torch.device("cpu"))
    measured = engine_acceptance(name, target, eval_prompts("tiny-code", recorded["prompts"]))
    assert measured["identical"]
    assert measured["mean_accepted_per_step"] >= recorded["mean_accepted_per_step"] - 0.1
    assert "Held-out top-1" in (Path(bundled.path(name)) / "README.md").read_text()
