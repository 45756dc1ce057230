"""The model runner: an unmodified HF causal LM driven through our KV cache and tree attention.

`ModelRunner(model, max_cache_len)` switches the model's attention to `tree_attention` (through
transformers' `AttentionInterface`, no change to code or weights) until `close()` or the end of a
`with` block, which restore the original implementation.

Protocol for one batch of B sequences (what the engine does):

1. `out = runner.prefill(input_ids, attention_mask)`. Left or right padding is removed on the host
   side of the forward; every real prompt token **except the last** enters the cache, so
   `cache.cache_lens[b] = len_b - 1` and padding never does. `out.root_tokens` (int64 `[B]`) holds
   each prompt's last real token: the root of the first tree. `out.hidden_states[layer]` is
   `[B, T, H]`, row t the t-th cached token (rows `t >= cache_lens[b]` are padding).
2. Each step: the drafter proposes `tokens [B, N]` and `parents [B, N]` with node 0 the root (the
   last chosen token, not yet in the cache: `tokens[:, 0]` must hold it) and `parents[:, 0] = -1`.
   `v = runner.verify(tokens, parents)` feeds node i at position `cache_lens[b] + depth(i)` and
   writes its K/V at slot `cache_lens[b] + i`; `v.logits[b, i]` (fp32 `[B, N, V]`) is the
   distribution of node i's child, exactly what a plain forward over the prefix plus the
   root-to-node path gives at its last token.
3. `res = kernels.verify(v.logits, tokens, parents, ...)`, then
   `runner.cache.compact(res.accepted_nodes, res.num_accepted)`: the cache holds the prefix, the
   root and the accepted path, and `cache_lens` advanced by `num_accepted + 1` on the device.
   `res.next_tokens` is the next root.

Plain decoding is the same loop with N = 1 (`parents = [[-1]]`, accepting the root alone). Nodes
with parent -2 are padding: they see only themselves and nobody sees them, so they are harmless
(their token must still be a valid id; their logits are meaningless).

Sequences joining a running batch (continuous batching, `specdec_fast.serving`): `reserve(rows)`
sizes the storage and empties the batch; a newcomer's prompt is fed in chunks by
`extend_rows(start, tokens, cached)` into storage rows past the batch's end (a `SpecKVCache.rows`
view), between the batch's own steps or, on the CPU and without captured hidden states, on another
thread during them (`beside_step=True`), and `admit_rows` then appends those rows to the batch.
`prefill_rows(prompts)` does all three in one chunk (drafters' own caches use it). The batch's
rows keep their cache throughout.

Hidden states for drafters: `runner.capture_hidden([i, ...])` registers forward hooks; layer i is
the output of decoder layer i, and -1 is the final normed hidden state (the input of `lm_head`).
`prefill` and `verify` return them in `hidden_states`.

Compiled steps: the model forward of `prefill` and of `verify` runs through `torch.compile`
(fullgraph; the three kernels are custom ops inside it) unless `compile=False` or
`SPECDEC_COMPILE=0`. Batch size, cache capacity, prompt length and tree width are dynamic
dimensions from the first call (the compiler keeps size 1 apart: batch 1, and decode steps
against trees), so a handful of graphs serve every call. On CUDA, `verify` for a given (B, N)
is also captured as a CUDA graph on first use and replayed after; the returned tensors are then
static buffers, overwritten by the next `verify` of the same shape. A replayed step reads nothing
back from the device except for the capacity check, and that only near capacity. `prefill` reads
the prompt lengths once. After each compilation or capture the runner collects garbage and
freezes the heap (`gc.freeze`), so that later full collections skip the compiler's objects
instead of pausing a step for a quarter of a second.

`ModelRunner.for_model(model, ...)` keeps one runner per model (on the model object) and reopens
it for each `generate` call, so that the compiled steps, the CUDA graphs and the cache storage
of one call serve the next: a second call compiles and captures nothing. Runners of one thread may
nest on a model (a model drafting for itself); a runner opened from another thread while one
is open (a concurrent `generate` on the same model) raises a RuntimeError instead of
corrupting both.

Step metadata (tree masks, depths, positions, lengths) is built and checked once per step here;
the attention function of every layer then calls the kernel without validating again.
"""

import itertools
import threading
import weakref
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

from specdec_fast import graphs as cuda_graphs
from specdec_fast.attention import (
    ATTENTION_NAME,
    METADATA_KWARG,
    StepMetadata,
    check_model_attention,
    register_attention,
)
from specdec_fast.cache import SpecKVCache, attention_windows, model_shards
from specdec_fast.compiled import CompiledSteps, compile_by_default, freeze_by_default, kept
from specdec_fast.exact import switch_exact
from specdec_fast.kernels import pack_tree_mask, requested_backend
from specdec_fast.kernels.validation import check_tensor
from specdec_fast.notices import notice_once
from specdec_fast.onednn import switch_onednn, use_onednn
from specdec_fast.transfer import to_device
from specdec_fast.tree_mask import ancestor_mask, node_depths

FINAL_NORM = -1
INDEX_DTYPES = (torch.int32, torch.int64)
RUNNER_ATTRIBUTE = "_specdec_runner"
# MKL's fp32 GEMM runs 10-15 rows through a small-matrix path that is slower than its 16-row
# kernel: a SmolLM2-shaped verify at batch 1 takes 142 ms at N = 11, 167 ms at N = 15 and 121 ms
# at N = 16 on one thread (69, 77 and 64 ms on two). Trees in that band are verified at 16 rows.
MKL_SLOW_ROWS = range(10, 16)
MKL_FAST_ROWS = 16
# Guards the check-and-switch of a model's attention when runners open and close.
_OPEN_LOCK = threading.Lock()


def _step_kind(tokens: torch.Tensor) -> str:
    """ "decode" for one node per row, else "verify": each kind compiles its own code, so the
    compiled-code lookup of a step checks the guards of its own kind's graphs only."""
    return "decode" if tokens.shape[1] == 1 else "verify"


@dataclass
class PrefillOutput:
    """What `ModelRunner.prefill` returns.

    Attributes:
        root_tokens: int64 `[B]`, each prompt's last real token (not cached: the first root).
        cache_lens: int32 `[B]`, the cached prompt lengths (`len_b - 1`).
        hidden_states: `{layer: [B, T, H]}` for the captured layers, T = max cached length.
        logits: fp32 `[B, T, V]` for the cached tokens when asked for, else None.
    """

    root_tokens: torch.Tensor
    cache_lens: torch.Tensor
    hidden_states: dict[int, torch.Tensor]
    logits: torch.Tensor | None


@dataclass
class VerifyOutput:
    """What `ModelRunner.verify` returns.

    Attributes:
        logits: fp32 `[B, N, V]`; row i is the distribution of node i's child.
        hidden_states: `{layer: [B, N, H]}` for the captured layers, in the model's dtype.
        depths: int64 `[B, N]`, each node's depth in its tree (root and padded nodes 0).
        positions: int64 `[B, N]`, each node's position (`cache_lens[b]` + depth).
    """

    logits: torch.Tensor
    hidden_states: dict[int, torch.Tensor]
    depths: torch.Tensor
    positions: torch.Tensor


@dataclass
class _Switched:
    """A model switched to our attention: by which thread, how many open runners, from what."""

    thread: int
    runners: int
    original: str


# Models whose attention open runners switched. Runners of one thread nest (a model drafting
# for itself has two); a runner of another thread is refused while any is open.
_SWITCHED: "weakref.WeakKeyDictionary[nn.Module, _Switched]" = weakref.WeakKeyDictionary()


def _set_attention(model: nn.Module, name: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        # A draft head: a module of decoder layers over an HF config, no PreTrainedModel.
        model.config._attn_implementation = name
    else:
        setter(name)


def switch_attention(model: nn.Module, on: bool) -> None:
    """Switch `model` (an HF `PreTrainedModel`, or a draft head: a module whose layers read
    `model.config`) to our attention (`on`), or back to its own when the last runner of it
    closes. Runners of one thread nest; another thread's are refused while any is open."""
    model_type = model.config.model_type
    with _OPEN_LOCK:
        switched = _SWITCHED.get(model)
        if not on:
            switched.runners -= 1
            if switched.runners == 0:
                del _SWITCHED[model]
                _set_attention(model, switched.original)
            return
        if switched is not None:
            if switched.thread != threading.get_ident():
                raise RuntimeError(
                    f"{model_type}: this model is already driven by an open specdec-fast "
                    "ModelRunner in another thread (a concurrent generate() call on the same "
                    "model); calls on one model must not overlap: serialize them, or give each "
                    "thread its own model"
                )
            switched.runners += 1
            return
        check_model_attention(model)
        original = model.config._attn_implementation
        register_attention()
        _set_attention(model, ATTENTION_NAME)
        if model.config._attn_implementation != ATTENTION_NAME:
            _set_attention(model, original)
            raise ValueError(
                f"{model_type}: the model does not route attention through transformers' "
                f"AttentionInterface, so {ATTENTION_NAME!r} cannot be switched on"
            )
        _SWITCHED[model] = _Switched(threading.get_ident(), 1, original)


def step_metadata(
    cache: SpecKVCache,
    num_new: int,
    tree_mask: torch.Tensor | None,
    q_lens: torch.Tensor | None,
    max_cache_len: int,
    **fields,
) -> StepMetadata:
    """Point `cache`'s next write at slots `cache_lens[b] + i`, i < `num_new`, and return the
    attention's metadata for that forward (device ops only; `fields` are `StepMetadata`'s
    optional ones). Every forward over our caches, the target's and the draft heads', is
    prepared here.

    tree_mask: None (causal) or packed int32 `[B, num_new, words]`; q_lens: None or int32 `[B]`.
    """
    cache.prepare_write(num_new)
    return StepMetadata(cache.cache_lens, tree_mask, q_lens, max_cache_len, **fields)


def _runner_options(
    model: PreTrainedModel, use_cuda_graphs: bool | None, compile: bool | None, exact: bool
) -> tuple[bool, bool]:
    """(compile, CUDA graphs) as a runner of these options resolves them. Exact mode runs
    eagerly (its attention reads the step's lengths on the host), so it takes neither."""
    if exact:
        for name, value in (("compile", compile), ("use_cuda_graphs", use_cuda_graphs)):
            if value:
                raise ValueError(
                    f"{name}: exact mode runs the model eagerly; pass {name}=None or False "
                    "with exact=True"
                )
        return False, False
    compile = compile_by_default() if compile is None else compile
    graphs = cuda_graphs.capturable(model.device) if use_cuda_graphs is None else use_cuda_graphs
    return compile, graphs


def kept_runner(
    model: PreTrainedModel,
    *,
    use_cuda_graphs: bool | None = None,
    compile: bool | None = None,
    exact: bool = False,
) -> "ModelRunner | None":
    """The runner `ModelRunner.for_model` keeps on `model` for these options, if any (its
    `compile_seconds`, its cache)."""
    compile, graphs = _runner_options(model, use_cuda_graphs, compile, exact)
    runners = model.__dict__.get(RUNNER_ATTRIBUTE) or {}
    return runners.get((str(model.device), compile, graphs, exact))


def _decoder_modules(model: PreTrainedModel) -> tuple[nn.ModuleList, nn.Module | None]:
    """The decoder layers and the final norm of a causal LM (`model.get_decoder()`)."""
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{model.config.model_type}: cannot find the decoder layers "
            "(expected a ModuleList at model.get_decoder().layers)"
        )
    return layers, getattr(decoder, "norm", None)


class ModelRunner:
    """Runs prefill and tree verification of an HF causal LM over a `SpecKVCache`.

    Args:
        model: an HF `PreTrainedModel` for causal LM whose attention goes through
            `AttentionInterface` (Llama, Mistral, Qwen2/3, Gemma 1-3, ...), sliding windows and
            attention logit soft-capping included. The cache takes its dtype.
        max_cache_len: cache capacity per sequence (prompt and generated tokens, plus the N nodes
            of a verify step).
        use_cuda_graphs: capture and replay `verify` as CUDA graphs; default True on CUDA. Turn it
            off to debug; it cannot be on for a model on the CPU.
        compile: run the model forwards through `torch.compile`; default `SPECDEC_COMPILE`
            (on). The first call of each new shape pays the compilation (`compile_seconds`
            records it); later ones, in this call or a later one, do not.
        exact: exact mode (`specdec_fast.exact`): while open, the model's linear layers, norms
            and MLPs run batch-invariant forms and attention runs `tree_attention_exact`, so a
            token's logits do not depend on N or B. Runs eagerly, without CUDA graphs.

    Raises:
        ValueError: naming the model type, for attention this runner cannot serve, or for a
            model exact mode cannot serve; naming the option, for compile or CUDA graphs
            asked for with exact mode.
        RuntimeError: when a runner of another thread is open on the model.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        max_cache_len: int,
        *,
        use_cuda_graphs: bool | None = None,
        compile: bool | None = None,
        exact: bool = False,
    ):
        config = model.config.get_text_config(decoder=True)
        # Also refuses, before the attention is switched, layer kinds the cache cannot hold.
        self._layer_windows = tuple(attention_windows(config))
        self.model = model
        self.device = model.device
        self.exact = exact
        self.compile, self.use_cuda_graphs = _runner_options(model, use_cuda_graphs, compile, exact)
        if self.use_cuda_graphs and not cuda_graphs.capturable(self.device):
            raise ValueError(
                f"use_cuda_graphs needs a model on CUDA, the model is on {self.device}"
            )
        self._layers, self._final_norm = _decoder_modules(model)
        if self.device.type == "cpu" and requested_backend() == "triton":
            notice_once(
                "interpreter",
                "SPECDEC_BACKEND=triton on the CPU: the Triton kernels run under Triton's "
                "interpreter, in Python: about a second a step on the bundled tiny-code target, "
                "where the fused CPU kernels take milliseconds; leave SPECDEC_BACKEND unset for "
                "those",
            )
        self._onednn = use_onednn(model, self.compile, exact)
        self._mkl_rows = (
            self.device.type == "cpu"
            and model.dtype == torch.float32
            and torch.backends.mkl.is_available()
            and not exact
            and not self._onednn
        )
        self.cache: SpecKVCache | None = None
        self._captured: dict[int, torch.Tensor] = {}
        self._capture_layers: tuple[int, ...] = ()
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        # Inductor's freezing on the CPU (`freeze_by_default`): the compiled steps take the
        # model's weights as constants, and compile anew when one of them changes.
        self.freeze = (
            self.compile
            and self.device.type == "cpu"
            and freeze_by_default(sum(w.numel() * w.element_size() for w in self._weights()))
        )
        self.steps = CompiledSteps(
            model.config.model_type, self.compile, self._weights if self.freeze else None
        )
        # Wall time of the calls that compiled a graph (or captured a CUDA graph), by step shape.
        self.compile_seconds = self.steps.compile_seconds
        self._graphs = cuda_graphs.StepGraphs(
            f"{model.config.model_type} verify", self.use_cuda_graphs, on_capture=self.steps.record
        )
        self._open = False
        self.open(max_cache_len)

    @classmethod
    def for_model(
        cls,
        model: PreTrainedModel,
        max_cache_len: int,
        *,
        use_cuda_graphs: bool | None = None,
        compile: bool | None = None,
        exact: bool = False,
    ) -> "ModelRunner":
        """The model's own runner for these options, opened for `max_cache_len`: the one an
        earlier call left on the model (its compiled steps, graphs and cache storage kept), else
        a new one kept for the next call; while the kept one is open (a model drafting for
        itself), a second, transient one."""
        compile, graphs = _runner_options(model, use_cuda_graphs, compile, exact)
        runners = kept(model, RUNNER_ATTRIBUTE)
        key = (str(model.device), compile, graphs, exact)
        runner = runners.get(key)
        if runner is not None and runner.model is model and not runner._open:
            runner.open(max_cache_len)
            return runner
        fresh = cls(model, max_cache_len, use_cuda_graphs=graphs, compile=compile, exact=exact)
        if runner is None or runner.model is not model:
            runners[key] = fresh
        return fresh

    def __enter__(self) -> "ModelRunner":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def open(self, max_cache_len: int) -> None:
        """Switch the model to our attention for sequences of up to `max_cache_len` tokens."""
        if self._open:
            raise RuntimeError("this ModelRunner is already open")
        if max_cache_len < 1:
            raise ValueError(f"max_cache_len must be >= 1, got {max_cache_len}")
        if self.exact:
            # Before the attention switch: a model exact mode cannot serve leaves unchanged.
            switch_exact(self.model, on=True)
        try:
            switch_attention(self.model, on=True)
        except BaseException:
            if self.exact:
                switch_exact(self.model, on=False)
            raise
        if self._onednn:
            switch_onednn(self.model, on=True)
        self._open = True
        self.max_cache_len = max_cache_len

    def close(self) -> None:
        """Restore the model's original attention and remove the hooks (idempotent). Compiled
        steps, graphs and the cache storage stay for a later `open`."""
        if not self._open:
            return
        self._open = False
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._capture_layers = ()
        try:
            switch_attention(self.model, on=False)
        finally:
            if self.exact:
                switch_exact(self.model, on=False)
            if self._onednn:
                switch_onednn(self.model, on=False)

    def capture_hidden(self, layers: Sequence[int]) -> None:
        """Return these layers' hidden states from now on.

        Layer i is the output of decoder layer i (HF's `hidden_states[i + 1]`); -1 is the final
        normed hidden state, the input of `lm_head`. Replaces the previous selection.
        """
        self._check_open()
        modules = {}
        for layer in layers:
            if layer == FINAL_NORM and self._final_norm is not None:
                modules[layer] = self._final_norm
            elif 0 <= layer < len(self._layers):
                modules[layer] = self._layers[layer]
            else:
                raise ValueError(
                    f"layers: expected decoder layer indices in [0, {len(self._layers)}) or -1 "
                    f"(final norm, if the decoder has `norm`), got {layer}"
                )
        if tuple(modules) == self._capture_layers:
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks = [
            module.register_forward_hook(self._hook_for(layer)) for layer, module in modules.items()
        ]
        self._capture_layers = tuple(modules)

    @property
    def feeds_beside_steps(self) -> bool:
        """Whether `extend_rows(..., beside_step=True)` may run on another thread during a step:
        on the CPU (another core computes it; an accelerator's one stream would only queue it),
        with no hidden states captured (the hooks fill one dict per runner)."""
        return self.device.type == "cpu" and not self._capture_layers

    def _hook_for(self, layer: int):
        def hook(module, args, output):
            self._captured[layer] = output[0] if isinstance(output, tuple) else output

        return hook

    def prefill(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        return_logits: bool = False,
    ) -> PrefillOutput:
        """Start B sequences: cache each prompt except its last real token (see the module doc).

        Args:
            input_ids: int `[B, T]`, padded on either side.
            attention_mask: `[B, T]`, nonzero at real tokens; None means no padding. Every
                sequence needs at least one real token.
            return_logits: also return the logits of the cached tokens.

        Reads the prompt lengths back to the host (once). Resets the cache.
        """
        self._check_open()
        check_tensor("input_ids", input_ids, shape=(-1, -1), dims="[B, T]", dtypes=INDEX_DTYPES)
        batch, _ = input_ids.shape
        input_ids = input_ids.to(self.device)
        if attention_mask is None:
            real = torch.ones_like(input_ids, dtype=torch.bool)
        else:
            check_tensor("attention_mask", attention_mask, shape=input_ids.shape, dims="[B, T]")
            real = attention_mask.to(self.device) != 0
        lengths = real.sum(dim=1)
        lengths_host = lengths.tolist()
        if min(lengths_host) < 1:
            empty = lengths_host.index(min(lengths_host))
            raise ValueError(f"attention_mask: sequence {empty} has no real token")
        # A stable sort on "is padding" moves each row's real tokens to the front, in order.
        order = torch.sort((~real).to(torch.int8), dim=1, stable=True).indices
        packed = input_ids.gather(1, order)
        root_tokens = packed.gather(1, (lengths - 1)[:, None]).squeeze(1).long()
        cached_lens = (lengths - 1).to(torch.int32)
        num_cached = max(lengths_host) - 1

        self._ensure_cache(batch)
        self.cache.ensure_room(num_cached)
        if num_cached == 0:
            logits, hidden = self._empty_outputs(batch)
        else:
            positions = torch.arange(num_cached, device=self.device).expand(batch, -1)
            logits, hidden = self._run(
                "prefill",
                self._model_step,
                packed[:, :num_cached],
                positions,
                None,
                cached_lens,
                None,
                0 if return_logits else 1,
            )
        self.cache.commit_lengths(cached_lens, num_cached)
        return PrefillOutput(
            root_tokens=root_tokens,
            cache_lens=cached_lens,
            hidden_states=hidden,
            logits=logits if return_logits else None,
        )

    def verify(
        self, tokens: torch.Tensor, parents: torch.Tensor, q_lens: torch.Tensor | None = None
    ) -> VerifyOutput:
        """Run the target over a tree of N nodes per sequence (see the module doc).

        Args:
            tokens: int `[B, N]`, the token at each node; node 0 is the root.
            parents: int `[B, N]`, topological (`parents[b, i] < i`), -1 for the root, -2 for a
                padded node. Not read on the host.
            q_lens: optional int32 `[B]`: nodes `i >= q_lens[b]` are padding (zero attention).

        Returns:
            fp32 logits `[B, N, V]`, the captured hidden states `{layer: [B, N, H]}`, and each
            node's depth and position.

        Raises:
            ValueError: on bad shapes, or if `cache_lens[b] + N` could exceed `max_cache_len`
            (before anything is written).
        """
        self._check_open()
        if self.cache is None:
            raise RuntimeError("verify: call prefill first")
        batch = self.cache.kv.shape[2]
        check_tensor(
            "tokens",
            tokens,
            shape=(batch, -1),
            dims="[B, N]",
            dtypes=INDEX_DTYPES,
            device=self.device,
        )
        if tokens.shape[1] < 1:
            raise ValueError("tokens: expected N >= 1 nodes (the root at least), got N = 0")
        check_tensor(
            "parents",
            parents,
            shape=tokens.shape,
            dims="[B, N] of tokens",
            dtypes=INDEX_DTYPES,
            device=self.device,
        )
        if q_lens is not None:
            check_tensor(
                "q_lens",
                q_lens,
                shape=(batch,),
                dims="[B]",
                dtypes=INDEX_DTYPES,
                device=self.device,
            )
        self.cache.ensure_room(tokens.shape[1])
        self._graphs.bind(self.cache)
        # A captured graph returns the hidden states of the layers hooked at its capture.
        key = (q_lens is None, self._capture_layers)
        label = f"B={tokens.shape[0]} N={tokens.shape[1]}"
        return VerifyOutput(
            *self._graphs.run(key, label, self._run_verify, tokens, parents, q_lens)
        )

    def _run_verify(
        self, tokens: torch.Tensor, parents: torch.Tensor, q_lens: torch.Tensor | None
    ) -> tuple:
        return self._run(_step_kind(tokens), self._verify_step, tokens, parents, q_lens)

    def run_step(self, key: Hashable, label: str, step, *args):
        """`step(*args)`: a caller's own step over this runner's cache (a draft model's loop,
        PARD's tree step), through the runner's compiled steps as kind `key[0]` and, when the
        runner captures, replayed as a CUDA graph kept with its own (`StepGraphs`). `key` names
        everything the step reads besides its tensor arguments and this cache (the caller's
        envelope: its tree, its chain length); `label` names compilations and captures."""
        self._check_open()
        self._graphs.bind(self.cache)
        return self._graphs.run(key, label, self.steps.run, key[0], label, step, *args)

    def tree_logits(self, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[B, N, V]` of `verify`'s forward, its device ops alone: not compiled nor
        checked, for a caller's own compiled step that runs several forwards (a draft model's
        loop), which checks room first (`cache.ensure_room`)."""
        return self._verify_step(tokens, parents, None)[0]

    def verify_width(self, batch: int, nodes: int, widest: int) -> int:
        """How many nodes to verify a `[batch, nodes]` tree at, padding nodes added: for a
        drafted tree under CUDA graphs, `widest` (the caller's largest tree), so that each batch
        size has two step shapes; on an fp32 CPU model, enough for 16 rows when `batch * nodes`
        falls in MKL's slow band (`MKL_SLOW_ROWS`) and the cache has room (plain decoding of 10-15
        rows included: 2 nodes each); else `nodes`."""
        if self.use_cuda_graphs:
            return max(nodes, widest) if nodes > 1 else nodes
        if self._mkl_rows and batch * nodes in MKL_SLOW_ROWS:
            wider = -(-MKL_FAST_ROWS // batch)
            if self.cache is not None and self.cache.has_room(wider):
                return wider
        return nodes

    def keep(self, rows: Sequence[int] | torch.Tensor) -> None:
        """Keep only the sequences `rows` (indices into the batch, in that order): finished
        sequences leave the batch and stop costing work. The kept sequences move to the front of
        the cache storage in place, so captured graphs of each batch size stay valid."""
        self._check_open()
        if self.cache is None:
            raise RuntimeError("keep: call prefill first")
        self.cache.select(rows.tolist() if isinstance(rows, torch.Tensor) else rows)

    def reserve(self, rows: int) -> None:
        """Cache storage for up to `rows` sequences, and an empty batch: sequences then join it
        through `prefill_rows`, or `extend_rows` and `admit_rows` (continuous batching)."""
        self._check_open()
        if rows < 1:
            raise ValueError(f"rows: expected >= 1, got {rows}")
        self._ensure_cache(rows)
        self.cache.select([])

    def extend_rows(
        self,
        start: int,
        tokens: Sequence[Sequence[int]],
        cached: Sequence[int],
        *,
        beside_step: bool = False,
    ) -> dict[int, torch.Tensor]:
        """Feed `tokens[r]` to storage row `start + r`, past the batch's end, and commit them:
        one chunk of the prompts of sequences that join a running batch (`admit_rows` takes them
        in), while the batch's rows keep their cache.

        Args:
            start: the first storage row, at least the batch size B.
            tokens: per row, its next tokens (host lists, ragged, possibly empty), fed at
                positions `cached[r] + i` over the row's committed `cached[r]` tokens.
            cached: per row, the tokens already committed by earlier chunks (0 on the first:
                the row's earlier contents are forgotten).

            beside_step: the call may run on another thread while a step of the batch runs
                (`ModelRunner.feeds_beside_steps`): the forward then runs eagerly over the rows'
                own view, never through `self.cache`. The caller keeps the batch from reaching
                the rows and from admitting them until the call returns.

        Returns the captured hidden states `{layer: [n, T, H]}` of the fed tokens (T the longest
        chunk; rows past their own chunk are padding). Reads nothing back from the device.
        """
        self._check_open()
        if beside_step and not self.feeds_beside_steps:
            raise RuntimeError(
                "extend_rows: beside_step needs a CPU runner that captures no hidden states "
                "(feeds_beside_steps)"
            )
        if self.cache is None:
            raise RuntimeError("extend_rows: call reserve or prefill first")
        if len(tokens) != len(cached):
            raise ValueError(
                f"cached: expected one length per row of tokens ({len(tokens)}), got {len(cached)}"
            )
        batch = self.cache.kv.shape[2]
        if start < batch:
            raise ValueError(f"start: expected rows past the batch of {batch}, got {start}")
        count, width = len(tokens), max(len(row) for row in tokens)
        rows = self.cache.rows(start, count)
        lengths = [c + len(row) for c, row in zip(cached, tokens, strict=True)]
        if max(lengths) > self.max_cache_len:
            raise ValueError(
                f"tokens: {max(lengths)} tokens exceed the capacity max_cache_len = "
                f"{self.max_cache_len}"
            )
        rows.commit_lengths(to_device(cached, self.device, torch.int32), max(cached))
        if width == 0:
            return self._empty_outputs(count)[1]
        padded = np.zeros((count, width), dtype=np.int64)
        for row, chunk in enumerate(tokens):
            padded[row, : len(chunk)] = chunk
        positions = rows.cache_lens[:, None].long() + torch.arange(width, device=self.device)
        q_lens = to_device([len(row) for row in tokens], self.device, torch.int32)
        args = (to_device(padded, self.device), positions, None, q_lens, None, 1)
        if beside_step:
            # Eager, over the view passed in: the batch's step may be using `self.cache` now.
            with torch.no_grad():
                _, hidden = self._model_step(*args, rows)
        else:
            # The forward runs over the view: swap it in for the call (the steps read
            # `self.cache`).
            batch_cache, self.cache = self.cache, rows
            try:
                _, hidden = self._run("prefill", self._model_step, *args)
            finally:
                self.cache = batch_cache
        rows.commit_lengths(to_device(lengths, self.device, torch.int32), max(lengths))
        return hidden

    def admit_rows(self, start: int, count: int, max_length: int) -> None:
        """The storage rows `[start, start + count)`, filled by `extend_rows`, join the batch at
        its end (`SpecKVCache.admit`); `max_length` is their longest committed length."""
        self._check_open()
        self.cache.admit(start, count, max_length)

    def prefill_rows(self, prompts: Sequence[Sequence[int]]) -> PrefillOutput:
        """`prefill` for sequences joining the running batch, appended after its rows, which
        keep their cache: every prompt token except the last is cached (in one chunk), the
        storage grows when the batch outgrows it. `prompts`: host token lists (no device read);
        `hidden_states` cover the new rows only."""
        self._check_open()
        if not prompts or min(len(p) for p in prompts) < 1:
            raise ValueError("prompts: expected one or more non-empty token lists")
        if self.cache is None:
            self.reserve(len(prompts))
        batch = self.cache.kv.shape[2]
        if batch + len(prompts) > self.cache.capacity:
            self.cache = self.cache.with_capacity(max(batch + len(prompts), 2 * batch))
            self._graphs.clear()
        cached = [len(p) - 1 for p in prompts]
        hidden = self.extend_rows(batch, [p[:-1] for p in prompts], [0] * len(prompts))
        self.admit_rows(batch, len(prompts), max(cached))
        return PrefillOutput(
            root_tokens=to_device([p[-1] for p in prompts], self.device),
            cache_lens=to_device(cached, self.device, torch.int32),
            hidden_states=hidden,
            logits=None,
        )

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError("this ModelRunner is closed")

    def _ensure_cache(self, batch: int) -> None:
        """A cache for `batch` sequences of `max_cache_len` slots: the current storage when it
        fits (the compiled steps and captured graphs keep its addresses), else a new one."""
        dtype = self.model.dtype
        if self.cache is not None and self.cache.fits(batch, self.max_cache_len, dtype):
            self.cache.resize(batch)
            return
        self._graphs.clear()
        self.cache = None  # free the old storage before allocating the new one
        self.cache = SpecKVCache(
            self.model.config,
            batch,
            self.max_cache_len,
            dtype=dtype,
            device=self.device,
            shards=model_shards(self.model),
        )

    def _empty_outputs(self, batch: int) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        config = self.model.config.get_text_config(decoder=True)
        hidden = {
            layer: torch.zeros(
                batch, 0, config.hidden_size, dtype=self.model.dtype, device=self.device
            )
            for layer in self._capture_layers
        }
        logits = torch.zeros(batch, 0, config.vocab_size, device=self.device)
        return logits, hidden

    def _run(self, kind: str, step, *args):
        """`step(*args)` with no grad, through its compiled version (`CompiledSteps`, a
        `CompiledStep` per kind) when compiling; the calls that compiled a graph are timed into
        `compile_seconds`."""
        # Emptied out here, not inside the step: a compiled step guards on the dict it mutates,
        # and one that found the previous step's entries would compile a second graph.
        self._captured.clear()
        shape = args[0].shape
        return self.steps.run(kind, f"{kind} B={shape[0]} N={shape[1]}", step, *args)

    def _weights(self) -> Iterator[torch.Tensor]:
        return itertools.chain(self.model.parameters(), self.model.buffers())

    def _verify_step(
        self, tokens: torch.Tensor, parents: torch.Tensor, q_lens: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor], torch.Tensor, torch.Tensor]:
        """Tree mask and positions from `parents`, then the forward (device ops only)."""
        ancestors = ancestor_mask(parents)
        depths = node_depths(ancestors)
        positions = self.cache.cache_lens[:, None].long() + depths
        # A single node sees only itself, which is what the causal default gives.
        tree_mask = None if tokens.shape[1] == 1 else pack_tree_mask(ancestors)
        # Sliding windows measure distances between positions, which depths give in a tree.
        q_depths = None if tree_mask is None else depths.to(torch.int32)
        q_lens = None if q_lens is None else q_lens.to(torch.int32)
        logits, hidden = self._model_step(tokens, positions, tree_mask, q_lens, q_depths, 0)
        return logits, hidden, depths, positions

    def _model_step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        tree_mask: torch.Tensor | None,
        q_lens: torch.Tensor | None,
        q_depths: torch.Tensor | None,
        logits_to_keep: int,
        cache: SpecKVCache | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """One model forward writing K/V at `cache_lens[b] + i` of `cache` (default: the
        batch's); fp32 logits and hidden states."""
        cache = self.cache if cache is None else cache
        metadata = step_metadata(
            cache,
            tokens.shape[1],
            tree_mask,
            q_lens,
            self.max_cache_len,
            q_depths=q_depths,
            layer_windows=self._layer_windows,
            exact=self.exact,
        )
        output = self.model(
            input_ids=tokens,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **{METADATA_KWARG: metadata},
        )
        hidden = {layer: self._captured[layer] for layer in self._capture_layers}
        return output.logits.float(), hidden
