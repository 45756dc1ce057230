"""Notices for the person waiting on a long call: what a slow first call is doing (compiling a
step graph, interpreting the Triton kernels on the CPU), so that it does not look like a stall.

A notice goes to the library's logger, `specdec_fast`, at INFO when the application has
configured logging (a handler on that logger or an ancestor: it then decides what is shown),
else to stderr as one line: a script or the CLI that configured nothing still sees it.
"""

from __future__ import annotations

import logging
import sys

LOGGER = logging.getLogger("specdec_fast")
# Keys of the notices given once per process (`notice_once`).
_GIVEN: set[str] = set()


def notice(message: str) -> None:
    """Tell `message` (one line) to the logger, or to stderr without a logging setup."""
    if LOGGER.hasHandlers():
        LOGGER.info(message)
    else:
        print(f"specdec-fast: {message}", file=sys.stderr, flush=True)


def notice_once(key: str, message: str) -> None:
    """`notice(message)` the first time this process meets `key`."""
    if key not in _GIVEN:
        _GIVEN.add(key)
        notice(message)
