"""The OpenAI wire format: parsing completion and chat requests, shaping responses and errors.

`parse_request(parse_json(body), kind, ...)` turns the JSON body of `/v1/completions` (kind
"completion") or `/v1/chat/completions` (kind "chat") into `GenerationParams`, or raises
`RequestError`, which the server sends as a 400 in OpenAI's error shape:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": null}}

Supported fields: `model`, `prompt` (a string, or token ids, one prompt per request) or
`messages` (through the tokenizer's chat template; text content or text parts), `max_tokens`
(`max_completion_tokens` for chat), `temperature`, `top_p`, `top_k` (-1 or 0: off), `seed`,
`stop` (strings), `stop_token_ids`, `ignore_eos`, `stream`, `stream_options.include_usage` and
`stream_options.continuous_usage_stats` (usage in every chunk, as vLLM has it), `n` (1 only),
`user` (ignored). Fields that would change the output in ways the engine does not implement
(penalties, `logit_bias`, `logprobs`, `best_of`, `echo`, tools, a `response_format` other
than text) are refused rather than ignored.

`TextStream` decodes tokens incrementally for streaming: it holds back incomplete characters and
enough text to recognise a stop string that straddles two steps, and cuts at the first stop.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdec_fast.serving.errors import RequestError
from specdec_fast.text import check_messages, decode, encode_prompt

if TYPE_CHECKING:
    from specdec_fast.serving.limits import Limits

COMPLETION, CHAT = "completion", "chat"
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
# Fields accepted only at their neutral value: anything else would change the output unasked.
NEUTRAL = {
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "logit_bias": (None, {}),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "best_of": (None, 1),
    "echo": (None, False),
    "tools": (None, []),
    "functions": (None, []),
    "suffix": (None, ""),
    "response_format": (None, {"type": "text"}),
}
FINISH_REASONS = {
    "eos": "stop",
    "stop": "stop",
    "stop_string": "stop",  # the scheduler's STOP_STRING: the text reached a stop string
    "length": "length",
    "cache": "length",
}


@dataclass
class GenerationParams:
    """A parsed request.

    prompt_ids: the prompt's token ids; max_tokens: tokens to generate at most; stop: stop
    strings (cut from the output); stop_token_ids: extra stop ids (the stop token is kept in
    the token count, and in the text unless it is a special token, as vLLM does); model: the
    `model` field as given (None when absent).
    """

    kind: str
    model: str | None
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict, name: str, default: float, low: float, high: float, open_low=False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name}: expected a number, got {value!r}", name)
    if value < low or value > high or (open_low and value == low):
        bracket = "(" if open_low else "["
        raise RequestError(
            f"{name}: expected a number in {bracket}{low}, {high}], got {value}", name
        )
    return float(value)


def _prompt_ids(body: dict, kind: str, tokenizer, vocab_size: int) -> list[int]:
    if kind == CHAT:
        if "prompt" in body:
            raise RequestError("prompt: chat completions take `messages`", "prompt")
        messages = _messages(body.get("messages"))
        if getattr(tokenizer, "chat_template", None) is None:
            raise RequestError(
                "messages: the model's tokenizer has no chat template (start the server with "
                "--chat-template, or use /v1/completions)",
                "messages",
            )
        try:
            return encode_prompt(tokenizer, messages=messages, chat=True)
        except Exception as error:  # noqa: BLE001 - a template that fails on these messages
            raise RequestError(f"messages: the chat template failed: {error}", "messages") from None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt: expected a non-empty string", "prompt")
        return encode_prompt(tokenizer, prompt, chat=False)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        outside = [t for t in prompt if not 0 <= t < vocab_size]
        if outside:
            raise RequestError(
                f"prompt: token ids outside [0, {vocab_size}): {outside[:5]}", "prompt"
            )
        return list(prompt)
    raise RequestError(
        "prompt: expected a string or a list of token ids (one prompt per request), got "
        f"{json.dumps(prompt)[:200]}",
        "prompt",
    )


def _messages(messages) -> list[dict]:
    """OpenAI messages as {role, content} string pairs: text parts joined, names dropped, the
    `developer` role read as `system`."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: expected a non-empty list of messages", "messages")
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise RequestError(f"messages[{index}]: expected an object with a role", "messages")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise RequestError(
                        f"messages[{index}].content: only text parts are supported", "messages"
                    )
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        role = "system" if message["role"] == "developer" else message["role"]
        out.append({"role": role, "content": content})
    try:
        return check_messages(out)
    except ValueError as error:
        raise RequestError(str(error), "messages") from None


def parse_json(body: bytes) -> dict:
    """The JSON object of a request's body; `RequestError` for anything else."""
    try:
        values = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(values, dict):
        raise RequestError("the body must be a JSON object", code="invalid_json")
    model = values.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"model: expected a string, got {model!r}", "model")
    return values


def parse_request(
    values: dict, kind: str, tokenizer, vocab_size: int, context_len: int, limits: Limits
) -> GenerationParams:
    """The request `values` (`parse_json`'s) for endpoint `kind` ("completion" or "chat");
    raises `RequestError` naming the field for anything malformed, unsupported, over `limits`
    or too long for the context of `context_len` tokens (prompt plus max_tokens). The counts
    `limits` bounds are checked before the prompt is tokenized."""
    model = values.get("model")
    for name, neutral in NEUTRAL.items():
        if name in values and values[name] not in neutral:
            raise RequestError(f"{name}: not supported by this server", name, "unsupported")
    limits.check_counts(values)
    prompt_ids = _prompt_ids(values, kind, tokenizer, vocab_size)
    limits.check_prompt_tokens(len(prompt_ids), "messages" if kind == CHAT else "prompt")
    limit_name = "max_tokens"
    limit = values.get("max_tokens")
    if kind == CHAT and values.get("max_completion_tokens") is not None:
        limit_name, limit = "max_completion_tokens", values["max_completion_tokens"]
    if limit is not None and (not _is_int(limit) or limit < 1):
        raise RequestError(f"{limit_name}: expected an integer >= 1, got {limit!r}", limit_name)
    room = context_len - len(prompt_ids)
    if room < 1:
        raise RequestError(
            f"This model's maximum context length is {context_len} tokens, and the prompt has "
            f"{len(prompt_ids)}: no room to generate.",
            "messages" if kind == CHAT else "prompt",
            "context_length_exceeded",
        )
    if limit is None:
        limit = min(DEFAULT_COMPLETION_TOKENS, room) if kind == COMPLETION else room
        if limits.max_tokens is not None:
            limit = min(limit, limits.max_tokens)
    else:
        limits.check_max_tokens(limit, limit_name)
    if len(prompt_ids) + limit > context_len:
        raise RequestError(
            f"This model's maximum context length is {context_len} tokens. However, you "
            f"requested {len(prompt_ids) + limit} tokens ({len(prompt_ids)} in the prompt, "
            f"{limit} for the completion).",
            limit_name,
            "context_length_exceeded",
        )
    params = GenerationParams(kind, model, prompt_ids, limit)
    params.temperature = _number(values, "temperature", 1.0, 0.0, 2.0)
    params.top_p = _number(values, "top_p", 1.0, 0.0, 1.0, open_low=True)
    top_k = values.get("top_k", 0)
    if top_k is None:
        top_k = 0
    if not _is_int(top_k) or top_k < -1:
        raise RequestError(
            f"top_k: expected an integer >= -1 (-1 or 0: off), got {top_k!r}", "top_k"
        )
    params.top_k = max(top_k, 0)
    seed = values.get("seed")
    if seed is not None and not _is_int(seed):
        raise RequestError(f"seed: expected an integer, got {seed!r}", "seed")
    params.seed = seed
    stop = values.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
    ):
        raise RequestError(f"stop: expected a string or a list of strings, got {stop!r}", "stop")
    params.stop = list(stop or [])
    stop_ids = values.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(
        _is_int(t) and 0 <= t < vocab_size for t in stop_ids
    ):
        raise RequestError(
            f"stop_token_ids: expected token ids in [0, {vocab_size}), got {stop_ids!r}",
            "stop_token_ids",
        )
    params.stop_token_ids = list(stop_ids)
    for name in ("ignore_eos", "stream"):
        flag = values.get(name, False)
        if flag is not None and not isinstance(flag, bool):
            raise RequestError(f"{name}: expected a boolean, got {flag!r}", name)
        setattr(params, name, bool(flag))
    options = values.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError(f"stream_options: expected an object, got {options!r}", "stream_options")
    params.include_usage = bool(options.get("include_usage", False))
    params.continuous_usage = bool(options.get("continuous_usage_stats", False))
    return params


class TextStream:
    """Incremental decoding of one completion for streaming, with stop strings.

    `push(tokens)` returns the text that became final; once a stop string appears, the text is
    cut before it and `stopped` is set; `flush()` returns what was held back at the end. Each
    push decodes only the new tokens and a few before them (vLLM's prefix and read offsets:
    tokenizers that drop a leading space at the start of a decode still get it right), so a
    step costs the same at the end of a long completion as at its start.
    """

    def __init__(self, tokenizer, stop: list[str], keep_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.stop = stop
        self.keep_special_tokens = keep_special_tokens
        self.ids: list[int] = []
        self.text = ""  # the decoded text so far (cut at a stop)
        self.sent = 0  # characters of `text` returned
        self.stopped = False
        self._prefix = self._read = 0  # ids[_prefix:_read] were decoded as context
        # A stop string may straddle two pushes: hold back all but its first character.
        self._hold = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids, self.keep_special_tokens, quiet=False)

    def _advance(self, final: bool) -> None:
        """Append the text of the ids past `_read` (an incomplete last character, which
        decodes as U+FFFD until its last byte arrives, waits unless `final`)."""
        context = self._decode(self.ids[self._prefix : self._read])
        full = self._decode(self.ids[self._prefix :])
        if len(full) > len(context) and (final or not full.endswith("\ufffd")):
            self.text += full[len(context) :]
            self._prefix, self._read = self._read, len(self.ids)

    def push(self, tokens: list[int]) -> str:
        if self.stopped:
            return ""
        self.ids += tokens
        return self._step(final=False)

    def flush(self) -> str:
        return "" if self.stopped else self._step(final=True)

    def _step(self, final: bool) -> str:
        self._advance(final)
        cut = min((i for i in (self.text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            self.stopped = True
            return self._take(len(self.text))
        return self._take(len(self.text) if final else len(self.text) - self._hold)

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        delta = self.text[self.sent : end]
        self.sent = end
        return delta


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == CHAT else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finish_reason(reason: str) -> str:
    """OpenAI's finish reason for an engine's ("abort" for a request the server ended)."""
    return FINISH_REASONS.get(reason, "abort")


def response(kind: str, request_id: str, model: str, text: str, reason: str, usage_: dict) -> dict:
    """A whole (non-streamed) completion."""
    choice = {"index": 0, "logprobs": None, "finish_reason": reason}
    if kind == CHAT:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        "id": request_id,
        "object": "chat.completion" if kind == CHAT else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage_,
    }


def chunk(
    kind: str,
    request_id: str,
    model: str,
    text: str | None,
    reason: str | None = None,
    usage_: dict | None = None,
    role: bool = False,
) -> dict:
    """One streamed chunk: a text delta (None: no choice, the usage chunk), the finish reason
    on the last one, the usage when asked for; `role` opens a chat stream."""
    choices = []
    if text is not None:
        choice = {"index": 0, "logprobs": None, "finish_reason": reason}
        if kind == CHAT:
            delta = {"role": "assistant", "content": text} if role else {}
            if text or not reason:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        choices.append(choice)
    out = {
        "id": request_id,
        "object": "chat.completion.chunk" if kind == CHAT else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage_ is not None:
        out["usage"] = usage_
    return out


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
