"""Tiny randomly initialized causal LMs for engine tests (built from configs; no downloads)."""

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)


def tiny_llama(
    vocab_size: int = 96,
    hidden_size: int = 48,
    layers: int = 2,
    seed: int = 0,
    initializer_range: float = 0.3,
    eos_token_id: int | None = None,
) -> LlamaForCausalLM:
    """An fp32 Llama with GQA; a wide initializer gives peaked logits, so few greedy near-ties."""
    return _tiny_causal_lm(
        LlamaConfig,
        LlamaForCausalLM,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        layers=layers,
        seed=seed,
        initializer_range=initializer_range,
        eos_token_id=eos_token_id,
    )


def tiny_qwen2(
    vocab_size: int = 96, hidden_size: int = 48, seed: int = 0, initializer_range: float = 0.3
) -> Qwen2ForCausalLM:
    """`tiny_llama`'s shape as a Qwen2 (biased q/k/v projections)."""
    return _tiny_causal_lm(
        Qwen2Config,
        Qwen2ForCausalLM,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        layers=2,
        seed=seed,
        initializer_range=initializer_range,
        eos_token_id=None,
    )


def tiny_mistral(sliding_window: int, vocab_size: int = 96, seed: int = 0) -> MistralForCausalLM:
    """`tiny_llama`'s shape as a Mistral whose every layer slides a window of `sliding_window`."""
    return _tiny_causal_lm(
        MistralConfig,
        MistralForCausalLM,
        vocab_size=vocab_size,
        hidden_size=48,
        layers=2,
        seed=seed,
        initializer_range=0.3,
        eos_token_id=None,
        sliding_window=sliding_window,
    )


def _tiny_causal_lm(
    config_class,
    model_class,
    *,
    vocab_size: int,
    hidden_size: int,
    layers: int,
    seed: int,
    initializer_range: float,
    eos_token_id: int | None,
    **config_extra,
):
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=512,
        initializer_range=initializer_range,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        **config_extra,
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None
    )
    return model


def first_layers(model, count: int):
    """`model` (a Llama-style causal LM) cut in place to its first `count` decoder layers, and
    returned: a shallower copy of a real model for tests whose cost is per layer (compiling,
    dynamo's capture) and whose checks do not depend on the depth."""
    model.model.layers = model.model.layers[:count]
    model.config.num_hidden_layers = count
    return model


def repetitive_prompts(lengths, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts made of a short random motif repeated, so lookup drafters find matches."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for length in lengths:
        motif = torch.randint(
            vocab_size, (int(torch.randint(3, 7, (1,), generator=generator)),), generator=generator
        ).tolist()
        prompts.append((motif * (length // len(motif) + 1))[:length])
    return prompts


def write_gguf(path, model, tokenizer, chat_template: str | None = None) -> None:
    """Write a Llama `model` and its byte-level BPE `tokenizer` as a float32 GGUF file, the way
    llama.cpp's converter lays them out (tensor names, Q/K rotary permutation, metadata), so
    transformers' `gguf_file=` reads back the same model."""
    import json

    import gguf
    import numpy as np

    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t, _ in vocab]
    )
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    # transformers reads the EOS token through the BOS id, so both are written.
    writer.add_bos_token_id(tokenizer.eos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)

    def permute(weights, heads):
        # llama.cpp interleaves the rotary halves of each head of Q and K.
        shape = weights.shape
        return weights.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2)

    for name, tensor in model.state_dict().items():
        module, suffix = name.rsplit(".", 1)
        data = tensor.detach().float().numpy()
        if module.endswith("q_proj"):
            data = permute(data, config.num_attention_heads).reshape(data.shape)
        elif module.endswith("k_proj"):
            data = permute(data, config.num_key_value_heads).reshape(data.shape)
        writer.add_tensor(f"{names.get_name(module)}.{suffix}", np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
