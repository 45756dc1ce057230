"""Notices for the person waiting on a long call: what a slow first call is doing (compiling a
step graph, interpreting the Triton kernels on the CPU), so that it does not look like a stall.

A notice goes to the library's logger, `specdec_fast`, at INFO when the application has
configured logging (a handler on that logger or an ancestor: it then decides what is shown),
else to stderr as one line: a script or the CLI that configured nothing still sees it.
"""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

LOGGER = logging.getLogger("specdec_fast")
# Keys of the notices given once per process (`notice_once`).
_GIVEN: set[str] = set()


def notice(message: str) -> None:
    """Tell `message` (one line) to the logger, or to stderr without a logging setup (above a
    progress bar there, if one is showing: `specdec_fast.progress`)."""
    if LOGGER.hasHandlers():
        LOGGER.info(message)
    else:
        tqdm.write(f"specdec-fast: {message}", file=sys.stderr)


def notice_once(key: str, message: str) -> None:
    """`notice(message)` the first time this process meets `key`."""
    if key not in _GIVEN:
        _GIVEN.add(key)
        notice(message)
