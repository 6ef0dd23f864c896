"""From an OpenAI-style request to the `RequestInfo` strategies see: pure, bytes and strings in.

Only `POST /v1/chat/completions`, `/v1/completions` and `/v1/responses` are routed (their body
names a model and their response reports usage); `GET /v1/models` is answered by the gateway from
discovery.

What is read, and why:
- `model`, `stream`, `stream_options.include_usage`: which pods, and how usage will arrive.
- The prompt's size: characters of every text part (chat `messages[].content` as a string or as
  `{"type": "text", "text": ...}` parts; completions `prompt` as a string or a list of them;
  Responses `instructions` and `input`, a string or items shaped like chat messages) and
  a token estimate from a `Tokenizer`; token-id prompts (`[1, 2, ...]`) count exactly. SLO
  routing predicts prefill time from it.
- The prompt's text parts themselves, in order (`RequestInfo.prompt_parts`): prefix-cache hashes
  them. Collected by reference during the same walk, so other strategies pay an append a part.
- `max_completion_tokens` (else `max_tokens`, else the Responses API's `max_output_tokens`): the
  most the request can decode. A value that is
  not a positive integer reads as absent; the engine answers for it.
- SLO headers (`x-slo-ttft-ms`, `x-slo-tpot-ms`: the Gateway API Inference Extension's names),
  AIBrix's `external-filter` label selector (`plugin.core.selector`), arrival time and request
  id come from the request's headers phase.

Walking the parsed body costs a few microseconds per request; the JSON decode itself (orjson)
stays the dominant cost, and it is needed anyway to read the model.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from plugin.core.selector import LabelSelector
from plugin.core.types import RequestInfo, SloTarget
from plugin.errors import BadRequestBody, BadRequestHeader, NoModel

__all__ = [
    "DEFAULT_TOKENIZER",
    "LLM_PATHS",
    "MODELS_PATH",
    "SLO_TPOT_HEADER",
    "SLO_TTFT_HEADER",
    "USAGE_OPTION_PATHS",
    "CharRatioTokenizer",
    "Tokenizer",
    "models_list",
    "parse_request",
    "parse_slo",
    "with_usage_requested",
]

# Paths whose JSON body names a model and whose response reports usage; others pass through.
LLM_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
# Answered by the gateway itself from discovery (OpenAI's model list).
MODELS_PATH = "/v1/models"
# Paths whose streams report usage only when asked (`stream_options.include_usage`).
USAGE_OPTION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
_STREAM_OPTIONS = b'"stream_options"'
_ASK_USAGE = b'"stream_options":{"include_usage":true},'
SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TPOT_HEADER = "x-slo-tpot-ms"


class Tokenizer(Protocol):
    """Counts (or estimates) the tokens of one text part of a prompt."""

    def count(self, text: str) -> int: ...


@dataclass(frozen=True, slots=True)
class CharRatioTokenizer:
    """Tokens estimated as characters / `chars_per_token`, rounded up per text part.

    No vocabulary, nothing to download, about 0.1 us a part. Four characters a token is the
    usual figure for English text with BPE vocabularies; rounding up per part stands in for the
    few template tokens each chat message adds.
    """

    chars_per_token: float = 4.0

    def count(self, text: str) -> int:
        return math.ceil(len(text) / self.chars_per_token)


DEFAULT_TOKENIZER: Tokenizer = CharRatioTokenizer()


def models_list(models: Iterable[str]) -> bytes:
    """OpenAI's `GET /v1/models` body for the models discovery knows."""
    data = [
        {"id": m, "object": "model", "created": 0, "owned_by": "hetero-gateway"} for m in models
    ]
    return orjson.dumps({"object": "list", "data": data})


def _slo_ms(name: str, raw: str | None) -> float | None:
    if raw is None or not raw.strip():
        return None
    try:
        ms = float(raw)
    except ValueError:
        ms = math.nan
    if not (math.isfinite(ms) and ms > 0):
        raise BadRequestHeader(name, f"{name} must be a positive number of milliseconds")
    return ms / 1000.0


def parse_slo(ttft_ms: str | None, tpot_ms: str | None) -> SloTarget | None:
    """The SLO headers' targets (seconds); None when neither is set; 400 when one is malformed."""
    ttft = _slo_ms(SLO_TTFT_HEADER, ttft_ms)
    tpot = _slo_ms(SLO_TPOT_HEADER, tpot_ms)
    if ttft is None and tpot is None:
        return None
    return SloTarget(ttft, tpot)


def _token_text(ids: list[Any]) -> str | None:
    """A token-id prompt as text for prefix hashing: each id's 4 bytes as 4 characters, made in
    one C pass (no Python work per id); None when an item is not an int32 (the caller walks)."""
    try:
        return array("i", ids).tobytes().decode("latin-1")
    except (TypeError, OverflowError):
        return None


def _prompt_size(doc: dict[str, Any], tokenizer: Tokenizer) -> tuple[int, int, tuple[str, ...]]:
    """(characters, tokens, text parts) of the prompt; token ids count one token each.

    Text parts are the strings the walk meets anyway, appended by reference (nothing is joined
    or copied; prefix-cache hashes them). A flat token-id prompt (the usual form) is counted and
    turned into text in one C pass, cheaper than the Python step per id it replaces.
    """
    chars = tokens = 0
    parts: list[str] = []
    messages = doc.get("messages")
    if not isinstance(messages, list):
        # The Responses API: `instructions` (a system message) and `input`, a string or a list
        # of items shaped like chat messages (`content`: a string or parts with `text`).
        instructions, messages = doc.get("instructions"), doc.get("input")
        if isinstance(messages, str):
            messages = [{"content": messages}]
        if isinstance(instructions, str) and isinstance(messages, list):
            messages = [{"content": instructions}, *messages]
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, str):
                chars += len(content)
                tokens += tokenizer.count(content)
                parts.append(content)
            elif isinstance(content, list):
                for part in content:
                    text = part.get("text") if isinstance(part, dict) else None
                    if isinstance(text, str):
                        chars += len(text)
                        tokens += tokenizer.count(text)
                        parts.append(text)
        return chars, tokens, tuple(parts)
    prompt = doc.get("prompt")
    if isinstance(prompt, str):
        return len(prompt), tokenizer.count(prompt), (prompt,)
    if isinstance(prompt, list):
        ids = _token_text(prompt)
        if ids is not None:  # every item an int: one token each
            return 0, len(prompt), (ids,) if ids else ()
        for item in prompt:
            if isinstance(item, str):
                chars += len(item)
                tokens += tokenizer.count(item)
                parts.append(item)
            elif isinstance(item, int):
                tokens += 1
            elif isinstance(item, list):
                tokens += len(item)
                ids = _token_text(item)
                if ids:
                    parts.append(ids)
    return chars, tokens, tuple(parts)


def _positive_int(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def parse_request(
    body: bytes,
    request_id: str = "",
    *,
    arrived_at: float = 0.0,
    slo: SloTarget | None = None,
    pod_selector: LabelSelector | None = None,
    tokenizer: Tokenizer = DEFAULT_TOKENIZER,
) -> RequestInfo:
    """Read what routing needs from an OpenAI-style body; raise the request error otherwise."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise BadRequestBody("request body is not valid JSON") from None
    if not isinstance(doc, dict):
        raise BadRequestBody("request body must be a JSON object")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise NoModel()
    options = doc.get("stream_options")
    chars, tokens, parts = _prompt_size(doc, tokenizer)
    max_tokens = (
        _positive_int(doc.get("max_completion_tokens"))
        or _positive_int(doc.get("max_tokens"))
        or _positive_int(doc.get("max_output_tokens"))  # the Responses API's name
    )
    return RequestInfo(
        model,
        doc.get("stream") is True,
        isinstance(options, dict) and options.get("include_usage") is True,
        len(body),
        request_id,
        chars,
        tokens,
        max_tokens,
        slo,
        arrived_at,
        pod_selector=pod_selector,
        prompt_parts=parts,
    )


def with_usage_requested(body: bytes, request: RequestInfo) -> bytes | None:
    """The body of a stream that did not ask for usage, asking for it; None: leave it as it is.

    An engine then reports the exact output tokens in a final usage chunk, which the gateway
    takes out of the client's stream again. Nothing changes for a request that is not streamed,
    already asks for usage, or asks for `continuous_usage_stats` (usage in every chunk, which
    the client would then see). The usual body names no `stream_options`: the option is put
    in front of its keys without decoding it again; otherwise it is decoded and re-encoded.
    """
    if not request.stream or request.include_usage:
        return None
    if _STREAM_OPTIONS not in body:
        start = body.find(b"{")  # the object's own brace: only whitespace precedes it
        if start < 0:
            return None
        return body[: start + 1] + _ASK_USAGE + body[start + 1 :]
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    options = doc.get("stream_options")
    if isinstance(options, dict):
        if options.get("continuous_usage_stats") is True:
            return None
        doc["stream_options"] = {**options, "include_usage": True}
    else:
        doc["stream_options"] = {"include_usage": True}
    return orjson.dumps(doc)
