"""Byte-level BPE tokenizer for the code corpus, saved in the Hugging Face layout.

The tokenizer prepends BOS when asked for special tokens (`tokenizer(text)`), matching the packed
training streams where every document starts with BOS; corpus encoding skips special tokens and
adds BOS/EOS itself.
"""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
DEFAULT_VOCAB_SIZE = 4096


def train_tokenizer(texts: list[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE with BOS/EOS/PAD (ids 0, 1, 2) on `texts`."""
    if not 4096 <= vocab_size <= 8192:
        raise ValueError(f"vocab_size: expected 4096 to 8192, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: str | Path) -> PreTrainedTokenizerFast:
    """Save `tokenizer` as tokenizer.json + tokenizer_config.json, loadable with AutoTokenizer."""
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    hf_tokenizer.save_pretrained(str(out_dir))
    return hf_tokenizer


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a saved tokenizer folder offline."""
    return AutoTokenizer.from_pretrained(str(path))
