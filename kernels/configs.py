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
  residual race (one of RACE_TILE_CANDIDATES).
"""

import json
from functools import cache
from pathlib import Path

CONFIG_PATH = Path(__file__).with_name("configs.json")


@cache
def tuned_configs() -> dict:
    """The configuration file's contents, read once per process (`tuned_configs.cache_clear()`
    after writing it)."""
    return json.loads(CONFIG_PATH.read_text())


def write_configs(updates: dict) -> dict:
    """Merge `updates` into the configuration file, write it, and return the new contents."""
    merged = {**tuned_configs(), **updates}
    CONFIG_PATH.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    tuned_configs.cache_clear()
    return merged
