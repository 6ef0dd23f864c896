"""Token usage scanner for LLM response bodies (bytes in, counts out).

Envoy streams each response body to the plugin chunk by chunk, and the plugin counts the output
tokens from the ``usage`` the engine reports. This runs for every response chunk, so it works on
raw bytes with C-speed ``find``/``count`` calls, JSON-decodes only lines that contain ``"usage"``
(and not merely ``"usage":null``), and keeps only the trailing partial line between chunks.

Two body shapes are understood:

- SSE (streaming): one JSON document per ``data:`` line. Chat/completions put the totals in a
  final chunk ``{"choices": [], "usage": {...}}`` (when the request asked for
  ``stream_options.include_usage``); the Responses API puts them in the ``response.completed``
  event under ``response.usage``.
- Plain JSON (non-streaming): the whole body, decoded once at the end of the stream.

Both ``prompt_tokens``/``completion_tokens`` and ``input_tokens``/``output_tokens`` namings are
accepted. Garbage never raises: it just yields no usage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

import orjson

__all__ = ["CHARS_PER_TOKEN", "Usage", "UsageScanner", "sse_from_content_type"]

# Looked up at call time (not bound into the class), so tests can count decodes.
_json_loads = orjson.loads

_USAGE_KEY: Final = b'"usage"'
_USAGE_NULLS: Final = (b'"usage":null', b'"usage": null')
_DATA: Final = b"data:"
_NL_DATA: Final = b"\ndata:"
_DONE: Final = (b"data: [DONE]", b"data:[DONE]")
_NL_DONE: Final = (b"\ndata: [DONE]", b"\ndata:[DONE]")
# Skipped at the very start of a body: whitespace and the bytes of a UTF-8 byte-order mark.
_LEADING_JUNK: Final = b" \t\r\n\xef\xbb\xbf"
_JSON_START: Final = b"{["

_UNDECIDED: Final = 0
_SSE: Final = 1
_JSON: Final = 2


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts as the engine reported them (Responses-API names mapped to chat names)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def sse_from_content_type(content_type: str | None) -> bool | None:
    """Map a response ``content-type`` to ``UsageScanner(sse=...)``; None lets the body decide."""
    if not content_type:
        return None
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "text/event-stream":
        return True
    if media == "application/json" or media.endswith("+json"):
        return False
    return None


class UsageScanner:
    """Scans one response body for the engine's token usage. One per response.

    Feed every body chunk in order; the last one with ``end_of_stream=True`` (an empty chunk is
    fine). The body shape is detected from its first non-whitespace byte (``{``/``[`` is JSON,
    anything else is scanned as SSE, which only ever acts on ``data:`` lines) unless ``sse`` forces
    it. A partial SSE line longer than ``max_buffer_bytes`` is dropped, as is a JSON body longer
    than that (its usage stays None), so a hostile body cannot grow memory without bound.

    Known limits: an SSE event whose JSON spans several ``data:`` lines is not reassembled (LLM
    engines send one line per event), and a lone ``\\r`` is not treated as a line end.
    """

    __slots__ = (
        "_at_start",
        "_buf",
        "_data_events",
        "_ended",
        "_estimate",
        "_max",
        "_mode",
        "_over_cap",
        "_skip_line",
        "_usage",
        "_usage_only_events",
    )

    def __init__(self, *, max_buffer_bytes: int = 8 * 1024 * 1024, sse: bool | None = None) -> None:
        if max_buffer_bytes < 1:
            raise ValueError(f"max_buffer_bytes must be positive, got {max_buffer_bytes}")
        self._max = max_buffer_bytes
        self._mode: int = _UNDECIDED if sse is None else (_SSE if sse else _JSON)
        # SSE: the trailing partial line; JSON: the body so far.
        self._buf = bytearray()
        self._at_start = True
        self._ended = False
        self._over_cap = False
        self._skip_line = False
        self._usage: Usage | None = None
        self._data_events = 0
        self._usage_only_events = 0
        self._estimate = 0  # a JSON body without usage: tokens estimated from its text

    @property
    def usage(self) -> Usage | None:
        """The last valid usage seen (engines send it once, at the end)."""
        return self._usage

    @property
    def data_events(self) -> int:
        """SSE ``data:`` lines seen, excluding ``data: [DONE]``."""
        return self._data_events

    @property
    def sse(self) -> bool | None:
        """True/False once the body shape is known (forced or detected), else None."""
        return None if self._mode == _UNDECIDED else self._mode == _SSE

    def output_tokens(self) -> int:
        """Reported completion tokens, or an estimate when the engine reported none.

        The SSE estimate is the number of data events that are neither ``[DONE]`` nor usage-only
        chunks. It is approximate: vLLM streams about one token per event, but other engines (and
        the Responses API's bookkeeping events) make it drift; the gateway asks engines for usage
        so that it is rarely needed. A JSON body without usage is estimated from the characters
        of its generated text (`CHARS_PER_TOKEN`).
        """
        if self._usage is not None:
            return self._usage.completion_tokens
        if self._mode == _SSE:
            return max(0, self._data_events - self._usage_only_events)
        return self._estimate

    @property
    def estimated(self) -> bool:
        """True when `output_tokens` is the gateway's estimate, not the engine's report."""
        return self._usage is None

    def feed(self, chunk: bytes, end_of_stream: bool = False) -> None:
        """Consume the next body chunk; never raises on malformed input."""
        if self._ended:
            return
        start = 0
        if self._at_start:
            start = _leading_junk(chunk)
            if start < len(chunk):
                self._at_start = False
                if self._mode == _UNDECIDED:
                    self._mode = _JSON if chunk[start] in _JSON_START else _SSE
        if self._mode == _SSE:
            self._feed_sse(chunk, start, end_of_stream)
        elif self._mode == _JSON:
            self._feed_json(chunk, start, end_of_stream)
        if end_of_stream:
            self._ended = True
            self._buf = bytearray()

    def _feed_sse(self, chunk: bytes, start: int, end_of_stream: bool) -> None:
        """Scan the complete lines in place; only the partial trailing line is copied."""
        buf = self._buf
        if self._skip_line:
            # The rest of an over-long line: drop bytes up to its end.
            nl = chunk.find(b"\n", start)
            if nl < 0:
                return
            self._skip_line = False
            start = nl + 1
        elif buf:
            nl = chunk.find(b"\n", start)
            if nl >= 0:
                # Complete the buffered line and scan it on its own.
                if len(buf) + nl + 1 - start <= self._max:
                    buf += memoryview(chunk)[start : nl + 1]
                    self._scan(buf, 0, len(buf))
                buf.clear()
                start = nl + 1
        last = chunk.rfind(b"\n", start)
        if last >= 0:
            self._scan(chunk, start, last + 1)
            start = last + 1
        if start < len(chunk):
            if len(buf) + len(chunk) - start > self._max:
                buf.clear()
                self._skip_line = True
            else:
                buf += memoryview(chunk)[start:]
        if end_of_stream and buf:
            # A final line without a newline.
            self._scan(buf, 0, len(buf))

    def _scan(self, buf: bytes | bytearray, start: int, end: int) -> None:
        """Account for the whole lines in ``buf[start:end]`` (``start`` is a line start)."""
        data = buf.count(_NL_DATA, start, end)
        done = buf.count(_NL_DONE[0], start, end) + buf.count(_NL_DONE[1], start, end)
        if buf.startswith(_DATA, start, end):
            data += 1
            if buf.startswith(_DONE, start, end):
                done += 1
        self._data_events += data - done
        # Walk usage lines backwards: the last valid one in the region wins, so once it is found
        # the earlier ones need no decoding (with continuous usage stats every chunk has one).
        hi = end
        while (hit := buf.rfind(_USAGE_KEY, start, hi)) >= 0:
            nl = buf.rfind(b"\n", start, hit)
            line_start = start if nl < 0 else nl + 1
            line_end = buf.find(b"\n", hit, end)
            if line_end < 0:
                line_end = end
            if self._usage_line(buf, line_start, line_end):
                return
            hi = line_start

    def _usage_line(self, buf: bytes | bytearray, start: int, end: int) -> bool:
        """Decode one line that mentions usage; True if it carried a valid usage."""
        if not buf.startswith(_DATA, start, end):
            return False
        # OpenAI sends `"usage":null` in every chunk when usage is requested: not worth a decode.
        keys = buf.count(_USAGE_KEY, start, end)
        nulls = buf.count(_USAGE_NULLS[0], start, end) + buf.count(_USAGE_NULLS[1], start, end)
        if nulls >= keys:
            return False
        obj = _decode(buf[start + len(_DATA) : end])
        if not isinstance(obj, dict):
            return False
        raw = _raw_usage(obj)
        if raw is None:
            return False
        choices = obj.get("choices")
        if not (isinstance(choices, list) and choices):
            self._usage_only_events += 1
        parsed = _parse_usage(raw)
        if parsed is None:
            return False
        self._usage = parsed
        return True

    def _feed_json(self, chunk: bytes, start: int, end_of_stream: bool) -> None:
        """Buffer the body (up to the cap) and decode it once, at the end, if it has usage."""
        if self._over_cap:
            return
        if len(self._buf) + len(chunk) - start > self._max:
            self._over_cap = True
            self._buf = bytearray()
            return
        self._buf += memoryview(chunk)[start:]
        if end_of_stream:
            obj = _decode(self._buf)
            if isinstance(obj, dict):
                if _USAGE_KEY in self._buf:
                    self._usage = _parse_usage(_raw_usage(obj))
                if self._usage is None:
                    self._estimate = _estimate_tokens(obj)


# Characters per output token when a response reports no usage: the usual figure for English
# text with BPE vocabularies (the request side's `CharRatioTokenizer` uses the same).
CHARS_PER_TOKEN: Final = 4.0


def _estimate_tokens(obj: dict[object, object]) -> int:
    """Output tokens of a non-streamed body without usage, from its generated text: chat
    `choices[].message.content`, completions `choices[].text`, Responses `output[].content[]
    .text`; at least one token per choice or output item that holds text."""
    texts: list[str] = []
    for key, inner in (("choices", "message"), ("output", "content")):
        items = obj.get(key)
        if not isinstance(items, list):
            continue
        for item in items:
            if not isinstance(item, dict):
                continue
            text = item.get("text")
            nested = item.get(inner)
            if isinstance(text, str):
                texts.append(text)
            elif isinstance(nested, dict) and isinstance(nested.get("content"), str):
                texts.append(nested["content"])
            elif isinstance(nested, list):
                texts.extend(
                    part["text"]
                    for part in nested
                    if isinstance(part, dict) and isinstance(part.get("text"), str)
                )
    return sum(max(1, math.ceil(len(t) / CHARS_PER_TOKEN)) for t in texts if t)


def _leading_junk(chunk: bytes) -> int:
    """How many whitespace/BOM bytes open ``chunk`` (usually none, so no copy)."""
    if not chunk or chunk[0] not in _LEADING_JUNK:
        return 0
    return len(chunk) - len(chunk.lstrip(_LEADING_JUNK))


def _decode(payload: bytes | bytearray) -> object:
    """JSON-decode, mapping any malformed input to None."""
    try:
        return _json_loads(payload)
    except ValueError:  # orjson.JSONDecodeError, also for invalid UTF-8
        return None


def _raw_usage(obj: dict[object, object]) -> object:
    """``usage`` at the top level (chat, completions, Responses body) or under ``response``."""
    raw = obj.get("usage")
    if raw is None:
        response = obj.get("response")
        if isinstance(response, dict):
            raw = response.get("usage")
    return raw


def _parse_usage(raw: object) -> Usage | None:
    """Validate a usage object; prompt and completion counts are required, total defaults."""
    if not isinstance(raw, dict):
        return None
    prompt = _count(raw, "prompt_tokens", "input_tokens")
    completion = _count(raw, "completion_tokens", "output_tokens")
    if prompt is None or completion is None:
        return None
    total_raw = raw.get("total_tokens")
    if total_raw is None:
        return Usage(prompt, completion, prompt + completion)
    total = _as_count(total_raw)
    if total is None:
        return None
    return Usage(prompt, completion, total)


def _count(raw: dict[object, object], name: str, alt_name: str) -> int | None:
    """The count under ``name`` (chat naming) or else ``alt_name`` (Responses naming)."""
    value = raw.get(name)
    if value is None:
        value = raw.get(alt_name)
    return _as_count(value)


def _as_count(value: object) -> int | None:
    """A non-negative int, or None (bools, floats, strings and negatives are not counts)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None
