"""Who may use the server: API keys, checked on every `/v1` route.

Keys come from `specdec-fast serve --api-key KEY` (repeatable) and from the environment variable
`SPECDEC_API_KEY` (several keys separated by commas). With at least one key, a request needs
`Authorization: Bearer KEY` with one of them, else a 401 in OpenAI's error shape (code
"invalid_api_key"); without keys every request is admitted. The token is compared with every key
in constant time (`hmac.compare_digest`, no early exit), so that the time of a refusal says
nothing about how much of a key was right. `/health` is always open, `/metrics` only with
`--metrics-auth` behind the keys.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Iterable, Mapping

API_KEY_ENV = "SPECDEC_API_KEY"


class ApiKeys:
    """The keys a request may present (none: the server is open)."""

    def __init__(self, keys: Iterable[str] = ()):
        self._keys = [key.encode() for key in keys if key]

    @classmethod
    def from_sources(
        cls, given: Iterable[str] | None, environ: Mapping[str, str] = os.environ
    ) -> ApiKeys:
        """The keys given on the command line and those of `SPECDEC_API_KEY` (comma-separated)."""
        from_env = [key.strip() for key in environ.get(API_KEY_ENV, "").split(",")]
        return cls([*(given or []), *from_env])

    def __bool__(self) -> bool:
        return bool(self._keys)

    def allows(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header's value carries one of the keys (any value does
        when there are none)."""
        if not self._keys:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        presented = token.strip().encode()
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(presented, key)
        return matched and scheme.lower() == "bearer"


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves only this machine ("localhost" or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False
