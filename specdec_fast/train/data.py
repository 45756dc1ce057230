"""Token streams of the corpus splits (cached on disk) and the deterministic batch order."""

import hashlib
import sys
from pathlib import Path

import numpy as np
import torch

from . import corpus
from .tokenizer import BOS_TOKEN, EOS_TOKEN, load_tokenizer


def token_stream(split: str, tokenizer_dir: str | Path, cache_dir: str | Path) -> np.ndarray:
    """The packed int32 token stream `[total_tokens]` of `split`, cached under `cache_dir`.

    The cache key covers the tokenizer file and the interpreter version, whose stdlib is the corpus.
    """
    tokenizer_json = Path(tokenizer_dir) / "tokenizer.json"
    key = hashlib.sha256(tokenizer_json.read_bytes() + sys.version.encode()).hexdigest()[:16]
    cache_file = Path(cache_dir) / f"{split}-{key}.npy"
    if cache_file.exists():
        return np.load(cache_file)
    tokenizer = load_tokenizer(tokenizer_dir)
    backend = tokenizer.backend_tokenizer
    encodings = backend.encode_batch(corpus.read_texts(split), add_special_tokens=False)
    stream = corpus.pack_documents(
        [encoding.ids for encoding in encodings],
        backend.token_to_id(BOS_TOKEN),
        backend.token_to_id(EOS_TOKEN),
    )
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    tmp_file = cache_file.with_suffix(".tmp.npy")
    np.save(tmp_file, stream)
    tmp_file.replace(cache_file)
    return stream


def num_windows(stream: np.ndarray, seq_len: int) -> int:
    """How many non-overlapping rows of `seq_len + 1` tokens (input plus shifted target) fit."""
    return (len(stream) - 1) // seq_len


def batch_at_step(
    stream: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int
) -> torch.Tensor:
    """Rows `[batch_size, seq_len + 1]` (int64) for training step `step`.

    Every epoch visits each window once in an order drawn from (seed, epoch), so a batch depends
    only on its step: resuming needs no data-loader state.
    """
    windows = num_windows(stream, seq_len)
    if windows < batch_size:
        raise ValueError(
            f"stream: expected at least {batch_size * seq_len + 1} tokens for batch_size="
            f"{batch_size} and seq_len={seq_len}, got {len(stream)}"
        )
    per_epoch = windows // batch_size
    epoch, index = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(windows)
    starts = order[index * batch_size : (index + 1) * batch_size] * seq_len
    rows = np.stack([stream[start : start + seq_len + 1] for start in starts])
    return torch.from_numpy(rows.astype(np.int64))


def weights_digest(model_dir: str | Path) -> str:
    """A short hash of a model folder's safetensors files (the generated data's cache key)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no safetensors weights to key the generated data with")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]
