"""Loading models and tokenizers as users hold them: HF folders, GGUF files, bundled names.

Nothing here reaches the network: `from_pretrained` runs with `local_files_only=True`, weights are
safetensors, GGUF (through transformers' `gguf_file=`, which needs the `gguf` extra) or
`torch.load(weights_only=True)` inside the drafters' loaders, and remote code is never trusted.
Drafters are built from specs in `specdec_fast.drafters.registry`.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from specdec_fast import bundled
from specdec_fast.files import FileFormatError, check_config_fields, read_json
from specdec_fast.gguf_files import MissingExtra as MissingExtra
from specdec_fast.gguf_files import require_gguf

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
GGUF_SUFFIX = ".gguf"
# The loggers of transformers' tokenizer warnings (clean_up_tokenization_spaces, lengths, ...).
TOKENIZER_LOGGERS = (
    "transformers.tokenization_utils_base",
    "transformers.tokenization_utils_tokenizers",
)


def resolve_path(name_or_path: str) -> str:
    """A local folder, or the folder of a bundled checkpoint of that name."""
    if os.path.isdir(name_or_path):
        return name_or_path
    if name_or_path in bundled.available():
        return bundled.path(name_or_path)
    raise ValueError(
        f"{name_or_path!r} is neither a folder nor a bundled model ({bundled.available()})"
    )


def resolve_model(name_or_path: str) -> tuple[str, str | None]:
    """(folder, GGUF file name or None) of a model folder, a `.gguf` file or a bundled name."""
    path = Path(name_or_path)
    if path.suffix.lower() == GGUF_SUFFIX:
        if not path.is_file():
            raise ValueError(f"{name_or_path!r}: no such GGUF file")
        return str(path.parent), path.name
    if path.is_file():
        raise ValueError(f"{name_or_path!r}: expected a model folder or a {GGUF_SUFFIX} file")
    return resolve_path(name_or_path), None


def pick_device(device: str | None) -> torch.device:
    """`device` (cpu, cuda, cuda:N), default cuda when available, else cpu."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        picked = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device: expected cpu, cuda or cuda:N, got {device!r}") from None
    if picked.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested, but torch sees no CUDA device")
    return picked


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """A torch dtype from `auto` (None), `float32`, `bfloat16` or `float16`."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return None
    if name not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPE_CHOICES)}, got {name!r}")
    return DTYPES[name]


def _checkpoint_dtype(folder: str, gguf_file: str | None) -> torch.dtype | None:
    """The floating dtype a folder's config.json records (None for GGUF or when absent); the
    file is checked on the way (`check_config_fields`: errors name it and the field)."""
    config = Path(folder) / "config.json"
    if gguf_file is not None or not config.is_file():
        return None
    recorded = check_config_fields(read_json(config), config)
    name = recorded.get("dtype") or recorded.get("torch_dtype")
    return DTYPES.get(name)


def auto_dtype(device: torch.device, checkpoint: torch.dtype | None) -> torch.dtype:
    """`auto`: float32 on the CPU (half-precision CPU matmuls are slow); on a GPU the checkpoint's
    own 16-bit dtype, else bfloat16."""
    if device.type == "cpu":
        return torch.float32
    return checkpoint if checkpoint in (torch.float16, torch.bfloat16) else torch.bfloat16


def native_half_precision(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `device` does `dtype` (bfloat16 or float16) matmuls in hardware: on a GPU,
    float16 always and bfloat16 where CUDA supports it; on the CPU, bfloat16 with AVX512-BF16
    or AMX and float16 with AMX-FP16 (elsewhere torch converts to float32 and back, slower
    than float32 itself)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    if device.type == "cuda":
        return dtype == torch.float16 or torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    probes = (
        ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        if dtype == torch.bfloat16
        else ("_is_amx_fp16_supported",)
    )
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def drafter_dtype(
    device: torch.device, stored: torch.dtype, target_dtype: torch.dtype
) -> torch.dtype:
    """The dtype a draft head computes in by default: the 16-bit dtype its checkpoint is stored
    in where `device` does that math in hardware (`native_half_precision`), else the target's.

    A drafter's precision changes which tokens it proposes, never what is emitted (verification
    decides against the target's own logits), so a float32 target on a CPU with bfloat16
    units still drafts at bfloat16 speed: the bundled DFlash head's step is about 1.2x faster
    so (bench/NOTES.md, 2026-12-04)."""
    if stored in (torch.float16, torch.bfloat16) and native_half_precision(device, stored):
        return stored
    return target_dtype


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Inside: no transformers progress bars and no tokenizer warnings; restored on exit, so
    only our own calls are silenced."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    loggers = [logging.getLogger(name) for name in TOKENIZER_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    # The GGUF reader draws its own tqdm bar, outside transformers' progress-bar switch.
    gguf_tqdm = gguf_utils.tqdm
    gguf_utils.tqdm = _silent(gguf_tqdm)
    try:
        yield
    finally:
        gguf_utils.tqdm = gguf_tqdm
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _silent(bar_class):
    def silent(*args, **kwargs):
        return bar_class(*args, **{**kwargs, "disable": True})

    return silent


def load_model(
    name_or_path: str,
    device: torch.device,
    dtype: torch.dtype | str | None = None,
    tp_size: int | None = None,
):
    """An HF causal LM from a folder, a `.gguf` file or a bundled name, in eval mode on `device`.

    dtype: a torch dtype or its name; None or "auto" picks `auto_dtype` (float32 on the CPU, the
    checkpoint's 16-bit dtype or bfloat16 on a GPU). GGUF weights are dequantized on loading.
    tp_size: shard the model over that many ranks of the initialized process group with
    transformers' own plan (`tp_plan="auto"`); each rank then holds its shard on `device`
    (`specdec_fast.parallel.load_target` checks the model first)."""
    from transformers import AutoModelForCausalLM

    folder, gguf_file = resolve_model(name_or_path)
    if gguf_file is not None:
        require_gguf()
    recorded = _checkpoint_dtype(folder, gguf_file)  # reads config.json: a bad field fails here
    dtype = parse_dtype(dtype) or auto_dtype(device, recorded)
    extra = {} if gguf_file is None else {"gguf_file": gguf_file}
    if tp_size is not None:
        from transformers.distributed import DistributedConfig

        extra["distributed_config"] = DistributedConfig(tp_plan="auto", tp_size=tp_size)
    from safetensors import SafetensorError

    with quiet_transformers():
        try:
            model = AutoModelForCausalLM.from_pretrained(
                folder, dtype=dtype, local_files_only=True, trust_remote_code=False, **extra
            )
        except SafetensorError as error:
            raise FileFormatError(
                f"{folder}: its weights are not a readable safetensors file (truncated or "
                f"corrupt?): {error}"
            ) from None
        except pickle.UnpicklingError:
            # transformers reads a .bin with torch.load(weights_only=True), which refuses
            # pickled objects with a page of advice: one line naming the file instead.
            raise FileFormatError(
                f"{folder}: its PyTorch weights hold pickled Python objects, which are never "
                "loaded (they could run code); save them with safetensors or "
                "torch.save(state_dict)"
            ) from None
    return (model if tp_size is not None else model.to(device)).eval()


def load_tokenizer(name_or_path: str):
    """The tokenizer of a folder, a `.gguf` file or a bundled name."""
    from transformers import AutoTokenizer

    folder, gguf_file = resolve_model(name_or_path)
    if gguf_file is not None:
        require_gguf()
    extra = {} if gguf_file is None else {"gguf_file": gguf_file}
    with quiet_transformers():
        return AutoTokenizer.from_pretrained(
            folder, local_files_only=True, trust_remote_code=False, **extra
        )
