"""EAGLE heads and `EagleDrafter`: exactness and losslessness through `generate` with random heads
on a random tiny target, the head's KV cache against a from-scratch recomputation, the dynamic
tree against a plain-Python EAGLE-2, the public checkpoint layouts, and the errors of a bad fit.
"""

import json

import pytest
import torch
from bench_smoke import import_bench
from test_generate import NEW_TOKENS, VOCAB, hf_greedy
from test_generate_sampling import P_MIN, chi_square_p, exact_pair_probs, sample_pairs
from tiny_models import repetitive_prompts, tiny_llama

from specdec_fast import EagleDrafter, generate
from specdec_fast.heads.eagle import Eagle3Head, EagleHead, load_eagle_head
from specdec_fast.runner import ModelRunner

HIDDEN = 48
SAMPLING_VOCAB = 16
# Greedy checks use a small vocabulary, where random heads' top-k guesses are right often enough
# for acceptance to be exercised on every run.
SMALL_VOCAB = 32


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB, layers=3)


@pytest.fixture(scope="module")
def small_target():
    return tiny_llama(vocab_size=SMALL_VOCAB, layers=3)


def make_head(version, model, seed=0):
    torch.manual_seed(seed)
    if version == 1:
        return EagleHead.for_target(model).eval()
    vocab = model.config.vocab_size
    # A reduced, shuffled draft vocabulary: two thirds of the target's ids.
    draft_ids = torch.randperm(vocab)[: 2 * vocab // 3].tolist()
    return Eagle3Head.for_target(model, draft_ids=draft_ids).eval()


TREE_ARGS = {
    "n8": dict(max_nodes=8),
    "n16": dict(max_nodes=16),
    "k2-d6-n10": dict(max_nodes=10, depth=6, top_k=2),
}


@pytest.mark.parametrize("lengths", [[13], [5, 17, 1, 30, 9]], ids=["batch1", "ragged5"])
@pytest.mark.parametrize("tree", list(TREE_ARGS))
@pytest.mark.parametrize("version", [1, 3], ids=["eagle1", "eagle3"])
def test_greedy_equals_hf_generate(small_target, version, tree, lengths):
    prompts = repetitive_prompts(lengths, SMALL_VOCAB, seed=len(lengths))
    drafter = EagleDrafter(make_head(version, small_target), **TREE_ARGS[tree])
    out = generate(small_target, prompts, drafter=drafter, max_new_tokens=NEW_TOKENS)
    assert [s.tolist() for s in out.sequences] == hf_greedy(small_target, prompts)
    assert out.stats.accepted_tokens > 0


@pytest.fixture(scope="module")
def sampling_target():
    return tiny_llama(vocab_size=SAMPLING_VOCAB, initializer_range=0.15, seed=2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "version, setting",
    [(1, (1.0, 0, 1.0)), (3, (1.0, 0, 1.0)), (3, (0.7, 5, 0.9))],
    ids=["eagle1-t1", "eagle3-t1", "eagle3-t0.7-k5-p0.9"],
)
def test_sampling_follows_the_target(sampling_target, version, setting):
    """Chi-square tests of the first two sampled tokens (the method and tolerance of
    tests/test_generate_sampling.py: p >= 1e-3 over 3000 seeded draws)."""
    temperature, top_k, top_p = setting
    drafter = EagleDrafter(make_head(version, sampling_target, seed=4), max_nodes=7, depth=2)
    counts, stats = sample_pairs(sampling_target, drafter, temperature, top_k, top_p, seed=31)
    exact = exact_pair_probs(sampling_target, temperature, top_k, top_p)
    assert chi_square_p(counts.sum(1), exact.sum(1)) >= P_MIN
    assert chi_square_p(counts, exact) >= P_MIN
    assert stats.accepted_tokens > 0


# --- the head's cache and the dynamic tree, against a from-scratch recomputation ---------------


class RecordingDrafter(EagleDrafter):
    """Keeps, per step, the tokens so far, the root entry's output and the proposal (row 0)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = []

    def propose(self, state):
        proposal = super().propose(state)
        self.steps.append((list(state.tokens[0]), self._outputs[0].clone(), proposal))
        return proposal


class FromScratch:
    """The head over whole entry sequences with plain causal attention and no cache."""

    def __init__(self, head, target, tokens):
        self.head, self.target = head, target
        cached = len(tokens) - 1
        with ModelRunner(target, cached + 1) as runner:
            runner.capture_hidden(head.target_layers)
            features = runner.prefill(torch.tensor([tokens])).hidden_states
        with torch.no_grad():
            self.prefix_hidden = head.fuse([features[layer] for layer in head.target_layers])[0]
        self.prefix_tokens = tokens[1:]  # entry t pairs feature t with token t + 1

    @torch.no_grad()
    def output(self, path=()):
        """The output of the last entry after the prefix and `path` ((hidden, token) pairs)."""
        hidden = torch.cat([self.prefix_hidden, *[h[None] for h, _ in path]])
        tokens = torch.tensor([self.prefix_tokens + [t for _, t in path]])
        before = self.head.config._attn_implementation
        self.head.config._attn_implementation = "sdpa"
        try:
            out = self.head(
                hidden[None],
                self.target.get_input_embeddings()(tokens),
                torch.arange(tokens.shape[1])[None],
            )
        finally:
            self.head.config._attn_implementation = before
        return out[0, -1]

    @torch.no_grad()
    def top(self, output, k):
        lm_head = self.target.get_output_embeddings()
        log_probs = torch.log_softmax(self.head.logits(output, lm_head).float(), dim=-1)
        best = log_probs.topk(k)
        return best.values.tolist(), self.head.to_target_ids(best.indices).tolist()

    def eagle2_tree(self, k, depth, draft_nodes):
        """Token paths of the `draft_nodes` nodes under the root of EAGLE-2's tree in (depth,
        best first) order, in plain Python."""
        root = self.output()
        scores, tokens = self.top(root, k)
        # (score, depth, order, token path, entries of the path)
        pairs = enumerate(zip(scores, tokens, strict=True))
        frontier = [(s, 1, i, (t,), ((root, t),)) for i, (s, t) in pairs]
        candidates = list(frontier)
        for level in range(2, depth + 1):
            children = []
            for parent in frontier:
                out = self.output(parent[4])
                scores, tokens = self.top(out, k)
                for s, t in zip(scores, tokens, strict=True):
                    order = len(candidates) + len(children)
                    children.append(
                        (parent[0] + s, level, order, (*parent[3], t), (*parent[4], (out, t)))
                    )
            candidates += children
            frontier = sorted(children, key=lambda c: -c[0])[:k]
        best = sorted(candidates, key=lambda c: (-c[0], c[2]))[:draft_nodes]
        return [c[3] for c in sorted(best, key=lambda c: (c[1], -c[0], c[2]))]


def proposal_paths(proposal, row=0):
    tokens, parents = proposal.tokens[row].tolist(), proposal.parents[row].tolist()
    paths = [()]
    for node in range(1, len(tokens)):
        paths.append((*paths[parents[node]], tokens[node]))
    return paths[1:]


@pytest.mark.parametrize("version", [1, 3], ids=["eagle1", "eagle3"])
def test_head_cache_and_tree_match_a_from_scratch_recomputation(target, version):
    head = make_head(version, target, seed=7)
    drafter = RecordingDrafter(head, max_nodes=8, depth=3, top_k=3)
    prompts = repetitive_prompts([11, 6], VOCAB, seed=9)
    out = generate(target, prompts, drafter=drafter, max_new_tokens=24)
    assert [s.tolist() for s in out.sequences] == hf_greedy(target, prompts, 24)
    assert out.stats.accepted_tokens > 0  # the cache followed accepted paths, not only roots
    for tokens, root_output, proposal in drafter.steps[:: max(len(drafter.steps) // 4, 1)]:
        scratch = FromScratch(head, target, tokens)
        torch.testing.assert_close(root_output, scratch.output(), rtol=1e-4, atol=1e-4)
        assert proposal.num_nodes == 8  # the root and 7 draft nodes
        assert proposal_paths(proposal) == scratch.eagle2_tree(k=3, depth=3, draft_nodes=7)


# --- checkpoints -------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 3], ids=["eagle1", "eagle3"])
def test_save_and_load_round_trip(target, tmp_path, version):
    head = make_head(version, target, seed=2)
    head.save_pretrained(tmp_path)
    loaded = load_eagle_head(tmp_path, target)
    assert type(loaded) is type(head) and loaded.target_layers == head.target_layers
    for (name, expected), (_, got) in zip(
        head.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(expected, got), name
    prompts = repetitive_prompts([9, 4], VOCAB, seed=4)
    outputs = [
        generate(target, prompts, drafter=EagleDrafter(h, max_nodes=8), max_new_tokens=12)
        for h in (head, loaded)
    ]
    assert [s.tolist() for s in outputs[1].sequences] == hf_greedy(target, prompts, 12)
    assert outputs[0].stats.accepted_tokens == outputs[1].stats.accepted_tokens


def public_eagle_state(config, version, generator, draft_vocab=None):
    """The keys and shapes of SafeAILab/EAGLE checkpoints (cnets1.py for EAGLE-1/2, cnets.py
    for EAGLE-3), written out by hand as an independent statement of the layout."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, vocab = hidden // heads, config["vocab_size"]
    prefix = "layers.0." if version == 1 else "midlayer."
    attention_in = hidden if version == 1 else 2 * hidden
    shapes = {
        f"{prefix}self_attn.q_proj.weight": (heads * head_dim, attention_in),
        f"{prefix}self_attn.k_proj.weight": (kv_heads * head_dim, attention_in),
        f"{prefix}self_attn.v_proj.weight": (kv_heads * head_dim, attention_in),
        f"{prefix}self_attn.o_proj.weight": (hidden, heads * head_dim),
        f"{prefix}mlp.gate_proj.weight": (inter, hidden),
        f"{prefix}mlp.up_proj.weight": (inter, hidden),
        f"{prefix}mlp.down_proj.weight": (hidden, inter),
        f"{prefix}post_attention_layernorm.weight": (hidden,),
        "embed_tokens.weight": (vocab, hidden),
    }
    if version == 1:
        shapes.update({"fc.weight": (hidden, 2 * hidden), "fc.bias": (hidden,)})
    else:
        shapes.update(
            {
                "fc.weight": (hidden, 3 * hidden),
                f"{prefix}hidden_norm.weight": (hidden,),
                f"{prefix}input_layernorm.weight": (hidden,),
                "norm.weight": (hidden,),
                "lm_head.weight": (draft_vocab, hidden),
            }
        )
    state = {key: torch.randn(shape, generator=generator) * 0.2 for key, shape in shapes.items()}
    if version == 3:
        draft_ids = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
        state["d2t"] = draft_ids - torch.arange(draft_vocab)
        state["t2d"] = torch.zeros(vocab, dtype=torch.bool)
        state["t2d"][draft_ids] = True
    return state


def write_public_eagle(folder, target, version, generator, **config_changes):
    base = target.config
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "hidden_size": base.hidden_size,
        "intermediate_size": base.intermediate_size,
        "num_attention_heads": base.num_attention_heads,
        "num_key_value_heads": base.num_key_value_heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "vocab_size": base.vocab_size,
        "max_position_embeddings": 512,
        "torch_dtype": "float16",
        "transformers_version": "4.28.1",
    }
    if version == 3:
        config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=40)
    config.update(config_changes)
    state = public_eagle_state(config, version, generator, config.get("draft_vocab_size"))
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(state, folder / "pytorch_model.bin")
    return state


@pytest.mark.parametrize("version", [1, 3], ids=["eagle1", "eagle3"])
def test_loads_the_public_layout(target, tmp_path, version):
    generator = torch.Generator().manual_seed(11)
    state = write_public_eagle(tmp_path, target, version, generator)
    head = load_eagle_head(tmp_path, target)
    assert head.version == version
    if version == 1:
        # The reference's decoder layer has no input norm.
        assert isinstance(head.layers[0].input_layernorm, torch.nn.Identity)
        torch.testing.assert_close(head.fc.bias, state["fc.bias"])
    else:
        assert head.target_layers == (0, 0, 1)  # 3 target layers: (0, L // 2 - 1, L - 2)
        ids = torch.arange(40)
        assert torch.equal(head.to_target_ids(ids), ids + state["d2t"])
    drafter = EagleDrafter.from_pretrained(tmp_path, target, max_nodes=8)
    prompts = repetitive_prompts([10, 3], VOCAB, seed=12)
    out = generate(target, prompts, drafter=drafter, max_new_tokens=16)
    assert [s.tolist() for s in out.sequences] == hf_greedy(target, prompts, 16)


def test_bad_checkpoints_and_misfits_raise_clear_errors(target, tmp_path):
    generator = torch.Generator().manual_seed(13)

    folder = tmp_path / "missing"
    state = write_public_eagle(folder, target, 1, generator)
    del state["layers.0.mlp.up_proj.weight"]
    state["layers.0.extra.weight"] = torch.zeros(1)
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"missing keys \['layers.0.mlp.up_proj.weight'\]"):
        load_eagle_head(folder, target)

    folder = tmp_path / "wide"
    write_public_eagle(folder, target, 1, generator, hidden_size=64, num_attention_heads=4)
    with pytest.raises(ValueError, match="embed_tokens.weight is \\(96, 64\\), the target's is"):
        load_eagle_head(folder, target)
    (folder / "pytorch_model.bin").unlink()
    state = public_eagle_state(json.loads((folder / "config.json").read_text()), 1, generator)
    del state["embed_tokens.weight"]
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="hidden_size is 64, the target's is 48"):
        load_eagle_head(folder, target)

    folder = tmp_path / "vocab"
    write_public_eagle(folder, target, 3, generator, vocab_size=VOCAB + 4)
    with pytest.raises(ValueError, match="embed_tokens.weight"):
        load_eagle_head(folder, target)

    folder = tmp_path / "d2t"
    state = write_public_eagle(folder, target, 3, generator)
    state["d2t"][-1] = VOCAB
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="d2t maps draft ids outside the target's 96 ids"):
        load_eagle_head(folder, target)

    folder = tmp_path / "qwen"
    write_public_eagle(folder, target, 1, generator, model_type="qwen2")
    with pytest.raises(ValueError, match="a qwen2 head cannot serve a llama target"):
        load_eagle_head(folder, target)

    with pytest.raises(ValueError, match="neither a folder nor a bundled model"):
        load_eagle_head(tmp_path / "nowhere", target)
    with pytest.raises(ValueError, match="over the 3 candidates"):
        EagleDrafter(make_head(1, target), max_nodes=5, depth=1, top_k=3)
    other = tiny_llama(vocab_size=VOCAB + 1)
    with pytest.raises(ValueError, match="vocab_size is 96, the target's is 97"):
        generate(other, [[1, 2, 3]], drafter=EagleDrafter(make_head(1, target)), max_new_tokens=2)


# --- compiled steps ---------------------------------------------------------------------------


def test_compiled_steps_equal_hf_greedy_with_no_eager_draft_work(small_target, monkeypatch):
    """In compiled mode the whole draft loop (head forwards, top-k, tree growth and selection)
    and the update are one compiled graph each: outputs equal HF's greedy decoding, the call
    reports both compilations, and a steady-state step dispatches no operator of the drafter's
    outside them (bench/step_ops.py; the engine's own ops stay, within issue 44's 30)."""
    step_ops = import_bench(monkeypatch, "step_ops")
    # One row: batch 1 and 2+ are separate graphs, and rows finishing early would compile both.
    prompts = repetitive_prompts([14], SMALL_VOCAB, seed=21)
    head = make_head(3, small_target, seed=5)

    def run(new_tokens):
        # Depth 2: the loop unrolls per depth in the graph, each level's expansion and rerank
        # the same code (depth 4 took the test's cold compile from 33 to 45 s).
        drafter = EagleDrafter(head, max_nodes=8, depth=2)
        return generate(
            small_target, prompts, drafter=drafter, max_new_tokens=new_tokens, compile=True,
            eos_token_id=[],
        )  # fmt: skip

    out = run(NEW_TOKENS)
    assert [s.tolist() for s in out.sequences] == hf_greedy(small_target, prompts)
    assert out.stats.accepted_tokens > 0
    labels = " ".join(out.stats.compiled)
    assert "eagle3 draft B=1" in labels and "eagle3 update B=1" in labels, labels
    counts = step_ops.step_counts(run, short=4, long=16)
    # The drafter's eager work would show as the head's operators (linear, its norms' rsqrt)
    # and the tree's (topk, sort): none may run outside the graphs.
    drafter_ops = {"aten::linear", "aten::rsqrt", "aten::topk", "aten::sort", "aten::log_softmax"}
    assert not drafter_ops & set(counts.ops), counts.ops
    assert counts.ops_per_step <= step_ops.MAX_EAGER_OPS, counts.row()


@pytest.mark.parametrize("version", [1, 3], ids=["eagle1", "eagle3"])
def test_a_step_reads_back_nothing_but_the_engines_read(small_target, version, monkeypatch):
    """The head's lengths stay on the device (bounded on the host from the token counts): a
    step's only blocking read is the engine's read-back (bench/step_ops.py's counter, as on an
    accelerator; the room checks used to read the head's lengths about every other step)."""
    step_ops = import_bench(monkeypatch, "step_ops")
    prompts = repetitive_prompts([12], SMALL_VOCAB, seed=8)
    head = make_head(version, small_target, seed=3)

    def run(new_tokens):
        drafter = EagleDrafter(head, max_nodes=8)
        return generate(
            small_target, prompts, drafter=drafter, max_new_tokens=new_tokens, eos_token_id=[]
        )

    counts = step_ops.step_counts(run, short=6, long=30)
    assert counts.reads_per_step == 1, counts.reads.most_common()
