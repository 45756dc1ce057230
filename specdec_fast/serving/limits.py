"""The server's own limits on a request's size, checked before the work they bound.

`Limits` holds them (`specdec-fast serve`'s flags set them; a route's `max_tokens` caps its
completions further, `RouteConfig.max_tokens`). The body's size is checked first, from its
`Content-Length` and again while it is read (a chunked body has none), so that an oversized body
is refused with a 413 before it is parsed or tokenized; the counts of messages, stop strings and
choices are checked on the parsed JSON before tokenization, the prompt's tokens once it is
encoded (token-id prompts before). Each refusal names the field and the limit in OpenAI's error
shape (`RequestError`, code "limit_exceeded"; 413: "request_too_large").
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec_fast.serving.errors import RequestError

# How long a draining server lets the requests in flight run on before cancelling them
# (`specdec_fast.serving.shutdown`). Here, beside the other limits, so that the command line
# reads it without importing the serve extra's packages (uvicorn).
DRAIN_DEADLINE_S = 30.0
MAX_BODY_BYTES = 1 << 20
MAX_MESSAGES = 256
MAX_STOP = 16


@dataclass(frozen=True)
class Limits:
    """max_body_bytes: a request body's bytes. max_messages: a chat's messages. max_stop: stop
    strings, and stop token ids, each. max_prompt_tokens: a prompt's tokens (None: only the
    context bounds it). max_tokens: tokens a completion may ask for (None: only the context).
    Only one choice per request is served (`n` 1)."""

    max_body_bytes: int = MAX_BODY_BYTES
    max_messages: int = MAX_MESSAGES
    max_stop: int = MAX_STOP
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_messages", "max_stop"):
            _check_positive(name, getattr(self, name))
        for name in ("max_prompt_tokens", "max_tokens"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))

    def with_route_cap(self, cap: int | None) -> Limits:
        """These limits with a route's `max_tokens` cap applied (the smaller wins)."""
        if cap is None or (self.max_tokens is not None and self.max_tokens <= cap):
            return self
        return Limits(
            self.max_body_bytes, self.max_messages, self.max_stop, self.max_prompt_tokens, cap
        )

    def check_declared_length(self, value: str | None) -> None:
        """A body's `Content-Length` header (None when chunked): 413 past the limit."""
        if value is None:
            return
        if not value.isdigit():
            raise RequestError(f"Content-Length: expected a byte count, got {value!r}")
        self.check_body_size(int(value))

    def check_body_size(self, size: int) -> None:
        if size > self.max_body_bytes:
            raise RequestError(
                f"the request body has more than {self.max_body_bytes} bytes "
                f"(--max-body-bytes): {size} bytes",
                code="request_too_large",
                status=413,
            )

    def check_counts(self, values: dict) -> None:
        """The counts a parsed body holds, before its prompt is tokenized."""
        messages = values.get("messages")
        if isinstance(messages, list) and len(messages) > self.max_messages:
            self._refuse("messages", len(messages), self.max_messages, "--max-messages")
        for name in ("stop", "stop_token_ids"):
            listed = values.get(name)
            if isinstance(listed, list) and len(listed) > self.max_stop:
                self._refuse(name, len(listed), self.max_stop, "--max-stop")
        n = values.get("n", 1)
        if n not in (None, 1):
            raise RequestError(
                f"n: at most 1 choice per request is served, got {n!r}", "n", "limit_exceeded"
            )
        prompt = values.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            self.check_prompt_tokens(len(prompt), "prompt")

    def check_prompt_tokens(self, count: int, field: str) -> None:
        if self.max_prompt_tokens is not None and count > self.max_prompt_tokens:
            self._refuse(field, count, self.max_prompt_tokens, "--max-prompt-tokens", "tokens")

    def check_max_tokens(self, count: int, field: str) -> None:
        if self.max_tokens is not None and count > self.max_tokens:
            self._refuse(field, count, self.max_tokens, "--max-tokens-limit or the route's")

    @staticmethod
    def _refuse(field: str, count: int, limit: int, flag: str, unit: str = "") -> None:
        what = f" {unit}" if unit else ""
        raise RequestError(
            f"{field}: at most {limit}{what} per request ({flag}), got {count}",
            field,
            "limit_exceeded",
        )


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
