"""The training corpus: the Python standard library source of the running interpreter.

The file list is deterministic: every `*.py` file under `sysconfig.get_paths()["stdlib"]`, sorted by
its path relative to that root, without `site-packages` and without test suites (`test/`, `tests/`,
`idle_test/`: mostly data fixtures and repetitive assertions). A fixed share of modules is held out
for evaluation and never trained on: a file is held out when the first 8 hex digits of the sha256 of
its relative path (POSIX separators, UTF-8), read as an integer, modulo 100 are below
`HELDOUT_PERCENT` (5), which keeps the split stable across machines and Python versions.

Token streams pack documents back to back as `BOS tokens EOS`; windows of them are training rows.
"""

import hashlib
import sysconfig
from pathlib import Path

import numpy as np

HELDOUT_PERCENT = 5
EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})
SPLITS = ("train", "heldout")


def stdlib_root() -> Path:
    """The standard library folder of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    """Whether the module at `relpath` (POSIX path relative to the stdlib root) is held out."""
    digest = hashlib.sha256(relpath.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % 100 < HELDOUT_PERCENT


def list_files(split: str, root: Path | None = None) -> list[str]:
    """Sorted POSIX paths, relative to `root` (default: the stdlib), of the files in `split`."""
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    root = stdlib_root() if root is None else Path(root)
    relpaths = sorted(
        path.relative_to(root).as_posix()
        for path in root.rglob("*.py")
        if not EXCLUDED_DIRS.intersection(path.relative_to(root).parts[:-1])
    )
    want_heldout = split == "heldout"
    return [rel for rel in relpaths if is_heldout(rel) == want_heldout]


def read_texts(split: str, root: Path | None = None) -> list[str]:
    """The source texts of `split`, in file-list order; files that are not UTF-8 are skipped."""
    root = stdlib_root() if root is None else Path(root)
    texts = []
    for rel in list_files(split, root):
        try:
            texts.append((root / rel).read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
    return texts


def pack_documents(token_lists: list[list[int]], bos_id: int, eos_id: int) -> np.ndarray:
    """Concatenate documents as `BOS doc EOS ...` into one int32 stream `[total_tokens]`."""
    pieces = [np.asarray([bos_id, *ids, eos_id], dtype=np.int32) for ids in token_lists]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
