"""oneDNN linears while an eager CPU runner of a float32 model is open (`specdec_fast.onednn`)."""

import pytest
import torch
from tiny_models import tiny_llama

from specdec_fast import NGramDrafter, generate
from specdec_fast.onednn import (
    ONEDNN_ENV,
    _onednn_linear,
    onednn_available,
    packed_weight,
    switch_onednn,
)
from specdec_fast.runner import ModelRunner

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")


def switched(model) -> list[str]:
    return [name for name, module in model.named_modules() if "forward" in module.__dict__]


def test_an_eager_runner_switches_every_linear_and_puts_them_back():
    model = tiny_llama(seed=3)
    linears = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        with ModelRunner(model, 64, compile=False):
            assert switched(model) == linears
            with ModelRunner(model, 64, compile=False):  # runners of a thread nest
                pass
            assert switched(model) == linears
            # Attention is ours while open; the linears alone are compared here.
            out = model.lm_head(model.model.norm(model.model.embed_tokens(ids)))
        assert switched(model) == []
        after = model(ids).logits
        reference = model.lm_head(model.model.norm(model.model.embed_tokens(ids)))
    assert torch.equal(before, after)
    # oneDNN adds in another order than MKL: float32 rounding apart, at most.
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["bfloat16", "compiled", "exact", "env off"])
def test_runners_that_keep_torchs_linear(case, monkeypatch):
    model = tiny_llama(seed=3)
    if case == "bfloat16":
        model = model.to(torch.bfloat16)
    if case == "env off":
        monkeypatch.setenv(ONEDNN_ENV, "0")
    options = {"compiled": {"compile": True}, "exact": {"exact": True}}.get(
        case, {"compile": False}
    )
    with ModelRunner(model, 64, **options):
        assert not switch_onednn.active(model)
        if case != "exact":
            assert switched(model) == []


def test_greedy_generate_through_onednn_equals_hf_greedy():
    """The switch is on during generate (checked from the streaming callback) and the output
    still equals HF's own greedy decoding, speculative and plain."""
    model = tiny_llama(seed=5)
    prompt = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    seen = []
    for drafter in (None, NGramDrafter(max_nodes=4)):
        out = generate(
            model,
            prompt,
            drafter=drafter,
            max_new_tokens=24,
            compile=False,
            on_tokens=lambda row, new: seen.append(switch_onednn.active(model)),
        )
        with torch.no_grad():
            hf = model.generate(prompt, max_new_tokens=24, do_sample=False)
        assert out.sequences[0].tolist() == hf[0].tolist()
    assert seen and all(seen)
    assert not switch_onednn.active(model)


def test_packed_weights_are_kept_until_the_weight_changes():
    """A layer's packed weight serves every later runner, gives the plain weight's results, and
    is packed again after an in-place update or a new weight tensor."""
    model = tiny_llama(seed=3)
    layer = model.lm_head
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = packed_weight(layer)
        assert packed_weight(layer) is first
        plain = torch.ops.mkldnn._linear_pointwise(x, layer.weight, None, "none", [], "")
        assert torch.equal(_onednn_linear(layer, x), plain)
        layer.weight.mul_(2)
        second = packed_weight(layer)
        assert second is not first
        torch.testing.assert_close(_onednn_linear(layer, x), 2 * plain, rtol=1e-6, atol=1e-6)
        layer.weight = torch.nn.Parameter(layer.weight / 2)
        third = packed_weight(layer)
    assert third is not second
    with torch.no_grad():
        torch.testing.assert_close(_onednn_linear(layer, x), plain, rtol=1e-6, atol=1e-6)


def test_a_forward_that_trains_a_switched_layer_reaches_its_weight():
    """With gradients on, the layer runs torch's linear on its own weight (oneDNN's op has no
    gradient, and the packed copy is detached)."""
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    _onednn_linear(layer, x).sum().backward()
    torch.testing.assert_close(layer.weight.grad, x.sum(0).expand(8, 16))
