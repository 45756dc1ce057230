"""The kernels' tuned configuration: `configs.json` beside this file.

The GPU suite's tuning part (bench/tune_kernels.py) sweeps candidates on the GPU and writes the
winners there; the file is committed, so every install launches what the last tuning run chose.
Each entry is an index into (or a value among) candidates that the launchers define and that the
sm_90 compile table covers (tests/sm90_compile.py sweeps every candidate):
- `tree_attention_decode_max_batch`: the largest batch that takes tree attention's decode
  schedule (at most MAX_DECODE_BATCH; 0 turns it off);
- `tree_attention_decode_tile`: per K/V width ("64", "128"), the index of the decode schedule's
  tile in DECODE_TILE_CANDIDATES;
- `verify_race_tiles`: walk tiles of vocabulary per slice of a rejected chain node's split
  residual race (one of RACE_TILE_CANDIDATES);
- `verify_stats_programs_per_sm`: the statistics launch's programs per SM that its vocabulary
  slices aim for (one of STATS_PROGRAMS_CANDIDATES).
"""

import contextlib
import json
from functools import cache
from pathlib import Path

CONFIG_PATH = Path(__file__).with_name("configs.json")
# Entries the tuning part sets while it times a candidate (see `overridden`).
_OVERRIDES: dict = {}


@cache
def _file_configs(path: Path) -> dict:
    return json.loads(path.read_text())


def tuned_configs() -> dict:
    """The configuration file's contents (read once per process), with any overrides on top."""
    return {**_file_configs(CONFIG_PATH), **_OVERRIDES}


@contextlib.contextmanager
def overridden(entries: dict):
    """Launch with `entries` in place of the file's (the tuning part times candidates so)."""
    saved = dict(_OVERRIDES)
    _OVERRIDES.update(entries)
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)


def write_configs(updates: dict, path: Path = CONFIG_PATH) -> dict:
    """Merge `updates` into the configuration file at `path`, write it, return its contents."""
    merged = {**_file_configs(CONFIG_PATH), **updates}
    path.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    _file_configs.cache_clear()
    return merged
