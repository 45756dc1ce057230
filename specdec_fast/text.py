"""Prompts in, text out: chat templates, prompt encoding and output decoding.

The command line, the demo and the harness go through these helpers, so a prompt is encoded the
same way everywhere: with the tokenizer's chat template when it has one (unless turned off), as
raw text after the BOS token otherwise; and outputs are decoded without special tokens unless
asked to keep them. Tokenizer warnings are silenced for these calls only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from specdec_fast.loading import quiet_transformers

ROLES = ("system", "user", "assistant", "tool")


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def use_chat(tokenizer, chat: bool | None) -> bool:
    """Whether prompts get the chat template: `chat` None means when the tokenizer has one."""
    if chat is None:
        return has_chat_template(tokenizer)
    if chat and not has_chat_template(tokenizer):
        raise ValueError("chat: the tokenizer has no chat template (use --no-chat)")
    return chat


def check_messages(messages, where: str = "messages") -> list[dict]:
    """`messages` as a non-empty list of {"role", "content"} string pairs; errors name `where`."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: expected a non-empty list of messages, got {messages!r}")
    for index, message in enumerate(messages):
        at = f"{where}[{index}]"
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise ValueError(f"{at}: expected an object with `role` and `content`, got {message!r}")
        if message["role"] not in ROLES:
            raise ValueError(
                f"{at}.role: expected one of {', '.join(ROLES)}, got {message['role']!r}"
            )
        if not isinstance(message["content"], str):
            raise ValueError(f"{at}.content: expected a string, got {message['content']!r}")
    return messages


def encode_prompt(
    tokenizer,
    prompt: str | None = None,
    messages: Sequence[dict] | None = None,
    chat: bool | None = None,
) -> list[int]:
    """Token ids of a prompt given as text or as chat `messages` (exactly one of them).

    With the chat template (`use_chat`): text becomes one user message, and the template adds the
    assistant's turn header. Without it: BOS (when the tokenizer has one) and the raw text;
    messages then need a template and raise ValueError."""
    if (prompt is None) == (messages is None):
        raise ValueError("give a prompt or messages, not both or neither")
    templated = use_chat(tokenizer, chat)
    if messages is not None and not templated:
        raise ValueError("messages: the prompt needs a chat template, which is off or missing")
    with quiet_transformers():
        if templated:
            turns = (
                list(messages) if messages is not None else [{"role": "user", "content": prompt}]
            )
            text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
            # The template writes the special tokens (BOS included) itself.
            return list(tokenizer.encode(text, add_special_tokens=False))
        ids = list(tokenizer.encode(prompt, add_special_tokens=False))
    bos = getattr(tokenizer, "bos_token_id", None)
    return ([bos] if bos is not None else []) + ids


def decode(
    tokenizer, ids: Sequence[int], keep_special_tokens: bool = False, quiet: bool = True
) -> str:
    """Text of `ids`, special tokens skipped unless kept, spaces left as the tokenizer made them.
    `quiet=False` skips the silencing of tokenizer warnings, which costs ten times the decoding
    of a few tokens (streaming decodes a few tokens per step)."""
    with quiet_transformers() if quiet else contextlib.nullcontext():
        return tokenizer.decode(
            list(ids),
            skip_special_tokens=not keep_special_tokens,
            clean_up_tokenization_spaces=False,
        )


def stop_token_ids(model, tokenizer) -> list[int]:
    """The ids that end a completion: the model's generation-config EOS ids and the tokenizer's
    EOS (a chat model's end-of-turn token is often only the latter)."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    own = getattr(tokenizer, "eos_token_id", None)
    if own is not None and own not in ids:
        ids.append(own)
    return ids
