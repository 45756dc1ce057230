"""ModelRunner: prefill and tree verification agree with the model's own plain forward.

Every tree node's logits must equal the logits of a plain forward (the model's original attention)
over the unpadded prefix plus the root-to-node path, step after step with compaction in between.
Tiny random fp32 models; weights drawn wide (initializer_range 0.2) so that attention is peaked and
a wrong position, mask or cache slot moves the logits far beyond the tolerance (see
`test_a_wrong_tree_is_detected`).
"""

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PhimoeConfig,
    PhimoeForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specdec_fast import generate
from specdec_fast.attention import ATTENTION_NAME, tree_attention_forward
from specdec_fast.graphs import GRAPH_WARMUP_CALLS
from specdec_fast.runner import ModelRunner

VOCAB = 160
CAPACITY = 64
# fp32 end to end; the only differences are summation orders (observed ~2e-6 on logits of ~3).
TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}
TINY = {
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 12,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,
}
# Each family as shipped in transformers, shrunk (windows wider than the cache: plain attention;
# narrow windows and soft-capping: NARROW below).
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 4096}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
    "gemma": (GemmaConfig, GemmaForCausalLM, {}),
    "gemma2": (
        Gemma2Config,
        Gemma2ForCausalLM,
        {"attn_logit_softcapping": None, "final_logit_softcapping": 30.0},
    ),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 512},
    ),
    # Its attention call gets no `sliding_window`: the window comes from the config alone.
    "phimoe": (
        PhimoeConfig,
        PhimoeForCausalLM,
        {"num_local_experts": 2, "num_experts_per_tok": 1, "sliding_window": 4096},
    ),
}


def tiny_model(family: str = "llama", **overrides) -> torch.nn.Module:
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    return model_class(config_class(**{**TINY, **extra, **overrides})).eval()


def padded_prompts(lengths: list[int], side: str, generator: torch.Generator):
    """Random prompts of the given lengths, padded with random (non-pad) tokens on one side."""
    width = max(lengths)
    input_ids = torch.randint(VOCAB, (len(lengths), width), generator=generator)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        if side == "left":
            attention_mask[row, width - length :] = 1
        else:
            attention_mask[row, :length] = 1
    return input_ids, attention_mask


def random_tree(batch: int, num_nodes: int, generator: torch.Generator):
    """Parents `[B, N]` of random trees; rows end in a random number of padded (-2) nodes."""
    parents = torch.full((batch, num_nodes), -2, dtype=torch.long)
    for row in range(batch):
        live = int(torch.randint(1, num_nodes + 1, (1,), generator=generator))
        parents[row, 0] = -1
        for node in range(1, live):
            parents[row, node] = int(torch.randint(node, (1,), generator=generator))
    return parents


def path_to(parents_row: torch.Tensor, node: int) -> list[int]:
    path = [node]
    while parents_row[path[-1]] >= 0:
        path.append(int(parents_row[path[-1]]))
    return path[::-1]


def run_and_record(
    runner, input_ids, attention_mask, num_nodes, steps, generator, *, with_q_lens=False
):
    """Prefill + `steps` verify/compact rounds; return (context, runner logits row) pairs.

    With `with_q_lens`, the padded nodes are also marked through `q_lens`.
    """
    prefill = runner.prefill(input_ids, attention_mask)
    batch = input_ids.shape[0]
    history = [input_ids[b][attention_mask[b].bool()][:-1].tolist() for b in range(batch)]
    roots = prefill.root_tokens.clone()
    expected_lens = torch.tensor([len(h) for h in history], dtype=torch.int32)
    torch.testing.assert_close(runner.cache.cache_lens, expected_lens)
    records = []
    for _ in range(steps):
        parents = random_tree(batch, num_nodes, generator)
        tokens = torch.randint(VOCAB, (batch, num_nodes), generator=generator)
        tokens[:, 0] = roots
        q_lens = (parents != -2).sum(dim=1).int() if with_q_lens else None
        logits = runner.verify(tokens, parents, q_lens).logits
        accepted_nodes = torch.full((batch, num_nodes), -1, dtype=torch.int32)
        num_accepted = torch.zeros(batch, dtype=torch.int32)
        for b in range(batch):
            live = int((parents[b] != -2).sum())
            for node in range(live):
                context = history[b] + tokens[b, path_to(parents[b], node)].tolist()
                records.append((context, logits[b, node]))
            path = path_to(parents[b], int(torch.randint(live, (1,), generator=generator)))
            accepted_nodes[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
            num_accepted[b] = len(path) - 1
            history[b] += tokens[b, path].tolist()
        runner.cache.compact(accepted_nodes, num_accepted)
        expected_lens = torch.tensor([len(h) for h in history], dtype=torch.int32)
        torch.testing.assert_close(runner.cache.cache_lens, expected_lens)
        roots = torch.randint(VOCAB, (batch,), generator=generator)
    return records


def assert_matches_plain_forward(model, records):
    with torch.no_grad():
        for context, logits in records:
            expected = model(torch.tensor([context])).logits[0, -1]
            torch.testing.assert_close(logits, expected, **TOLERANCE)


def check_steps_against_plain_forward(
    model, lengths, seed, *, capacity=CAPACITY, num_nodes=6, steps=3
):
    """Left-padded random prompts of `lengths`, `steps` random trees of `num_nodes`: every node's
    logits must match the plain forward."""
    generator = torch.Generator().manual_seed(seed)
    input_ids, attention_mask = padded_prompts(lengths, "left", generator)
    with ModelRunner(model, capacity) as runner:
        records = run_and_record(runner, input_ids, attention_mask, num_nodes, steps, generator)
    assert_matches_plain_forward(model, records)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_plain_forward(family):
    check_steps_against_plain_forward(tiny_model(family), [5, 9, 2], seed=1)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("lengths", [[1], [4], [7, 1, 3, 2, 6]], ids=["b1-len1", "b1", "b5"])
def test_ragged_batches(side, lengths):
    model = tiny_model()
    generator = torch.Generator().manual_seed(2)
    input_ids, attention_mask = padded_prompts(lengths, side, generator)
    with ModelRunner(model, CAPACITY) as runner:
        records = run_and_record(runner, input_ids, attention_mask, 5, 2, generator)
    assert_matches_plain_forward(model, records)


def test_padded_nodes_marked_by_q_lens():
    model = tiny_model()
    generator = torch.Generator().manual_seed(10)
    input_ids, attention_mask = padded_prompts([4, 2, 6], "right", generator)
    with ModelRunner(model, CAPACITY) as runner:
        records = run_and_record(
            runner, input_ids, attention_mask, 6, 2, generator, with_q_lens=True
        )
    assert_matches_plain_forward(model, records)


def test_plain_decoding_is_verify_with_one_node():
    model = tiny_model("qwen3")
    generator = torch.Generator().manual_seed(3)
    input_ids, attention_mask = padded_prompts([3, 6], "right", generator)
    with ModelRunner(model, CAPACITY) as runner:
        records = run_and_record(runner, input_ids, attention_mask, 1, 4, generator)
    assert_matches_plain_forward(model, records)


def test_a_wrong_tree_is_detected():
    """The comparison can fail: a tree verified as if it were a chain gives other logits."""
    model = tiny_model()
    generator = torch.Generator().manual_seed(4)
    prompt = torch.randint(VOCAB, (1, 6), generator=generator)
    tokens = torch.randint(VOCAB, (1, 3), generator=generator)
    with ModelRunner(model, CAPACITY) as runner:
        runner.prefill(prompt)
        tokens[0, 0] = prompt[0, -1]
        star = runner.verify(tokens, torch.tensor([[-1, 0, 0]])).logits[0, 2]
    with torch.no_grad():
        chain_context = torch.cat([prompt[0], tokens[0, 1:]])[None]
        as_chain = model(chain_context).logits[0, -1]
    assert (star - as_chain).abs().max() > 100 * TOLERANCE["atol"]


def test_hidden_states_are_captured():
    model = tiny_model("gemma")
    generator = torch.Generator().manual_seed(5)
    input_ids, attention_mask = padded_prompts([4, 6], "left", generator)
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, -2]])
    tokens = torch.randint(VOCAB, (2, 4), generator=generator)
    with ModelRunner(model, CAPACITY) as runner:
        runner.capture_hidden([0, -1])
        prefill = runner.prefill(input_ids, attention_mask, return_logits=True)
        tokens[:, 0] = prefill.root_tokens
        verified = runner.verify(tokens, parents)
    assert set(verified.hidden_states) == {0, -1}
    with torch.no_grad():
        for b in range(2):
            prompt = input_ids[b][attention_mask[b].bool()]
            plain = model(prompt[None, :-1], output_hidden_states=True)
            num_cached = len(prompt) - 1
            for got, want in (
                (prefill.hidden_states[0], plain.hidden_states[1]),
                (prefill.hidden_states[-1], plain.hidden_states[-1]),
                (prefill.logits, plain.logits),
            ):
                torch.testing.assert_close(got[b, :num_cached], want[0], **TOLERANCE)
            for node in range(3):
                context = torch.cat([prompt[:-1], tokens[b, path_to(parents[b], node)]])
                plain = model(context[None], output_hidden_states=True)
                # HF reports decoder layer i as hidden_states[i + 1], the last one after the norm.
                for layer, index in ((0, 1), (-1, -1)):
                    torch.testing.assert_close(
                        verified.hidden_states[layer][b, node],
                        plain.hidden_states[index][0, -1],
                        **TOLERANCE,
                    )


def test_overflow_is_refused_before_any_write():
    model = tiny_model()
    prompt = torch.randint(VOCAB, (2, 9), generator=torch.Generator().manual_seed(6))
    with ModelRunner(model, 12) as runner:
        with pytest.raises(ValueError, match="max_cache_len = 12"):
            runner.prefill(torch.randint(VOCAB, (1, 14)))
        runner.prefill(prompt)  # caches 8 tokens per sequence
        kv_before = runner.cache.kv.clone()
        lens_before = runner.cache.cache_lens.clone()
        with pytest.raises(ValueError, match="overflow: 5 new tokens on top of 8"):
            runner.verify(prompt[:, :5], torch.tensor([[-1, 0, 1, 2, 3]] * 2))
        assert torch.equal(runner.cache.kv, kv_before)
        assert torch.equal(runner.cache.cache_lens, lens_before)
        runner.verify(prompt[:, :4], torch.tensor([[-1, 0, 1, 2]] * 2))  # exactly full fits


def test_the_original_attention_is_restored():
    model = tiny_model()
    original = model.config._attn_implementation
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    prompt = torch.randint(VOCAB, (1, 5), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        before = model(prompt).logits
    runner = ModelRunner(model, CAPACITY)
    assert model.config._attn_implementation == ATTENTION_NAME
    with pytest.raises(RuntimeError, match="open ModelRunner"):
        model(prompt)
    runner.prefill(prompt)
    runner.close()
    runner.close()
    assert model.config._attn_implementation == original
    with pytest.raises(ValueError, match="boom"), ModelRunner(model, CAPACITY):
        raise ValueError("boom")
    assert model.config._attn_implementation == original
    with torch.no_grad():
        assert torch.equal(model(prompt).logits, before)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    with pytest.raises(RuntimeError, match="closed"):
        runner.prefill(prompt)


# Windows far narrower than the contexts (prompts of up to 20 tokens, three tree steps after) and
# attention logit soft-capping, against the models' eager attention (HF's SDPA path ignores
# soft-capping). A cap of 1 bends these tiny models' scores; 50 is Gemma2's own value.
NARROW = {
    "mistral-window4": ("mistral", {"sliding_window": 4}),
    "gemma3-window4": ("gemma3", {"sliding_window": 4}),
    "gemma2-window4-cap1": ("gemma2", {"sliding_window": 4, "attn_logit_softcapping": 1.0}),
    "gemma2-cap50": ("gemma2", {"attn_logit_softcapping": 50.0}),
    "phimoe-window4": ("phimoe", {"sliding_window": 4}),
}


def eager_model(name: str) -> torch.nn.Module:
    family, overrides = NARROW[name]
    model = tiny_model(family, **overrides)
    model.set_attn_implementation("eager")
    return model


@pytest.mark.parametrize("name", list(NARROW))
def test_narrow_windows_and_softcap_match_eager_forward(name):
    check_steps_against_plain_forward(eager_model(name), [20, 13, 2], seed=11)


@pytest.mark.parametrize(
    ("name", "without"),
    [
        ("mistral-window4", {"sliding_window": 4096}),
        ("gemma3-window4", {"sliding_window": 4096}),
        ("gemma2-window4-cap1", {"attn_logit_softcapping": None}),
        ("phimoe-window4", {"sliding_window": 4096}),
    ],
)
def test_windows_and_softcap_change_the_logits(name, without):
    """The comparisons above can fail: each feature moves the logits far beyond the tolerance."""
    family, overrides = NARROW[name]
    context = torch.randint(VOCAB, (1, 24), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        with_feature = eager_model(name)(context).logits[0, -1]
        plain = tiny_model(family, **{**overrides, **without})
        plain.set_attn_implementation("eager")
        without_feature = plain(context).logits[0, -1]
    assert (with_feature - without_feature).abs().max() > 100 * TOLERANCE["atol"]


def test_linear_attention_is_refused():
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**{**TINY, "num_experts": 2, "layer_types": None}))
    original = model.config._attn_implementation
    with pytest.raises(ValueError, match=r"qwen3_next: layer types \['linear_attention'\]"):
        ModelRunner(model, CAPACITY)
    assert model.config._attn_implementation == original


@pytest.mark.parametrize("compile", [False, True])
def test_attention_sinks_are_refused_before_any_step(compile):
    # Compiled, a check inside the attention call would surface as torch's own "Unsupported:
    # Observed exception" from the prefill's graph: the runner refuses the model when it opens.
    config = GptOssConfig(**{**TINY, "num_local_experts": 2, "num_experts_per_tok": 1})
    model = GptOssForCausalLM(config).eval()
    original = model.config._attn_implementation
    with pytest.raises(ValueError, match="gpt_oss: attention sinks are not supported"):
        generate(model, [[1, 2, 3]], drafter=None, max_new_tokens=2, compile=compile)
    assert model.config._attn_implementation == original


def test_cuda_graphs_need_cuda():
    with pytest.raises(ValueError, match="use_cuda_graphs"):
        ModelRunner(tiny_model(), CAPACITY, use_cuda_graphs=True)


def test_triton_kernels_end_to_end(triton_backend):
    """The same check with the Triton kernels (interpreted on the CPU), kept small."""
    model = tiny_model(num_hidden_layers=1)
    generator = torch.Generator().manual_seed(8)
    input_ids, attention_mask = padded_prompts([3, 5], "left", generator)
    with ModelRunner(model, 16) as runner:
        records = run_and_record(runner, input_ids, attention_mask, 4, 2, generator)
    assert_matches_plain_forward(model, records)


def test_triton_kernels_end_to_end_windowed_and_capped(triton_backend):
    """Gemma2 with a narrow window and a cap through the Triton kernels, kept small."""
    check_steps_against_plain_forward(
        eager_model("gemma2-window4-cap1"), [9, 4], seed=13, capacity=24, num_nodes=5, steps=2
    )


GRAPH_TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_matches_eager(dtype):
    model = tiny_model().to("cuda", dtype)
    generator = torch.Generator().manual_seed(9)
    input_ids, attention_mask = padded_prompts([5, 9, 2], "right", generator)
    parents = random_tree(3, 6, generator).cuda()
    drafts = torch.randint(VOCAB, (3, 6), generator=generator).cuda()  # the same for both runs
    outputs = {}
    for use_graphs in (False, True):
        with ModelRunner(model, CAPACITY, use_cuda_graphs=use_graphs) as runner:
            runner.capture_hidden([-1])
            prefill = runner.prefill(input_ids.cuda(), attention_mask.cuda())
            tokens = drafts.clone()
            tokens[:, 0] = prefill.root_tokens
            steps = []
            for _ in range(GRAPH_WARMUP_CALLS + 2):  # warm-up, a capture, a replay
                verified = runner.verify(tokens, parents)
                steps.append((verified.logits.clone(), verified.hidden_states[-1].clone()))
                accepted = torch.tensor([[0, 1, -1, -1, -1, -1]] * 3, dtype=torch.int32).cuda()
                accepted[:, 1] = torch.where(parents[:, 1] == 0, 1, -1).int()
                runner.cache.compact(accepted, (accepted[:, 1] >= 0).int())
        outputs[use_graphs] = steps
    for eager, graphed in zip(outputs[False], outputs[True], strict=True):
        for want, got in zip(eager, graphed, strict=True):
            # Same kernels either way; only library algorithm choices may differ under capture.
            torch.testing.assert_close(got, want, **GRAPH_TOLERANCE[dtype])


@pytest.mark.gpu
def test_cuda_graphs_captured_again_after_the_cache_grows():
    """A larger batch reallocates the cache and drops the graphs captured on the old one; the
    next capture needs a fresh memory pool (reusing the old one, whose graphs are all gone,
    fails the CUDA caching allocator's use-count assert), and replays as the eager step does."""
    model = tiny_model().to("cuda")
    generator = torch.Generator().manual_seed(10)
    small = padded_prompts([4], "right", generator)
    large = padded_prompts([5, 9, 2], "right", generator)
    parents = random_tree(3, 6, generator).cuda()
    drafts = torch.randint(VOCAB, (3, 6), generator=generator).cuda()
    outputs = {}
    for use_graphs in (False, True):
        with ModelRunner(model, CAPACITY, use_cuda_graphs=use_graphs) as runner:
            root = runner.prefill(*(t.cuda() for t in small)).root_tokens
            for _ in range(GRAPH_WARMUP_CALLS + 1):  # warm-up, then a capture
                runner.verify(torch.cat([root[:, None], drafts[:1, 1:]], 1), parents[:1])
            root = runner.prefill(*(t.cuda() for t in large)).root_tokens
            tokens = torch.cat([root[:, None], drafts[:, 1:]], 1)
            calls = range(GRAPH_WARMUP_CALLS + 2)
            outputs[use_graphs] = [runner.verify(tokens, parents).logits.clone() for _ in calls]
    for want, got in zip(outputs[False], outputs[True], strict=True):
        torch.testing.assert_close(got, want, **GRAPH_TOLERANCE[torch.float32])


def test_registered_with_hf_interfaces():
    model = tiny_model()
    with ModelRunner(model, CAPACITY):
        assert ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME] is tree_attention_forward
        mask = create_causal_mask(
            config=model.config,
            inputs_embeds=torch.zeros(1, 3, TINY["hidden_size"]),
            attention_mask=torch.ones(1, 3, dtype=torch.long),
            past_key_values=None,
        )
    assert mask is None
