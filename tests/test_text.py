"""Prompts in, text out (`specdec_fast.text`): chat templates, raw prompts, decoding without
special tokens, end-of-turn stops, and tokenizer warnings silenced for our calls only."""

import logging

import pytest
from test_cli import CHAT_TEMPLATE, tiny_tokenizer
from tiny_models import tiny_llama
from transformers import PreTrainedTokenizerFast

from specdec_fast.loading import TOKENIZER_LOGGERS
from specdec_fast.text import decode, encode_prompt, stop_token_ids, use_chat


def test_raw_and_chat_encoding():
    tokenizer = tiny_tokenizer()
    assert not use_chat(tokenizer, None)
    assert encode_prompt(tokenizer, "def f():") == tokenizer.encode(
        "def f():", add_special_tokens=False
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    assert use_chat(tokenizer, None) and not use_chat(tokenizer, False)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = "<|system|>Be brief.<eos><|user|>Hi<eos><|assistant|>"
    assert encode_prompt(tokenizer, messages=messages) == tokenizer.encode(
        expected, add_special_tokens=False
    )
    with pytest.raises(ValueError, match="not both or neither"):
        encode_prompt(tokenizer, "x", messages)
    with pytest.raises(ValueError, match="messages: the prompt needs a chat template"):
        encode_prompt(tokenizer, messages=messages, chat=False)


def test_decoding_skips_special_tokens_unless_kept():
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode("return a", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert decode(tokenizer, ids) == "return a"
    assert decode(tokenizer, ids, keep_special_tokens=True) == "return a<eos>"


def test_the_tokenizers_end_of_turn_stops_generation():
    model = tiny_llama(vocab_size=300, eos_token_id=7)
    tokenizer = tiny_tokenizer()
    assert stop_token_ids(model, tokenizer) == [7, tokenizer.eos_token_id]
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, 7]
    assert stop_token_ids(model, tokenizer) == [tokenizer.eos_token_id, 7]


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_tokenizer_warnings_are_silenced_for_our_calls_only():
    # A BPE tokenizer asking for the WordPiece space clean-up, which transformers warns about.
    bpe = tiny_tokenizer().backend_tokenizer
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<eos>", clean_up_tokenization_spaces=True
    )
    # transformers warns once per message and process: start from a clean slate.
    logging.Logger.warning_once.cache_clear()
    records = Records()
    loggers = [logging.getLogger(name) for name in TOKENIZER_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(records)
    try:
        ids = tokenizer.encode("a , b", add_special_tokens=False)
        assert decode(tokenizer, ids) == "a , b"  # spaces as tokenized, and no warning
        assert records.messages == []
        assert [logger.level for logger in loggers] == levels  # restored after our call
        tokenizer.decode(ids)  # the user's own call still warns
        assert any("clean_up_tokenization_spaces" in m for m in records.messages)
    finally:
        for logger in loggers:
            logger.removeHandler(records)
