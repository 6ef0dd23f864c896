"""Tests for the response-body token usage scanner (plugin.core.usage)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import pairwise
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugin.core import usage as usage_mod
from plugin.core.usage import Usage, UsageScanner, sse_from_content_type

pytestmark = pytest.mark.unit

# --------------------------------------------------------------------------------------------
# Fixtures: realistic bodies


def _sse(events: Iterable[object], *, done: bool = True, eol: str = "\n") -> bytes:
    """An SSE body with one `data:` line per event, as vLLM / OpenAI send it."""
    out = [f"data: {orjson.dumps(e).decode()}{eol}{eol}" for e in events]
    if done:
        out.append(f"data: [DONE]{eol}{eol}")
    return "".join(out).encode()


def _chat_chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "llama",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        **extra,
    }


_WORDS = ["Hé", "llo", ",", " 世界", " 🎉", " again", "!"]

CHAT_EVENTS: list[dict[str, Any]] = [
    _chat_chunk({"role": "assistant", "content": ""}),
    *(_chat_chunk({"content": w}) for w in _WORDS),
    _chat_chunk({}, finish="stop"),
    {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "llama",
        "choices": [],
        "usage": {"prompt_tokens": 12, "total_tokens": 19, "completion_tokens": 7},
    },
]
CHAT_STREAM = _sse(CHAT_EVENTS)
CHAT_USAGE = Usage(12, 7, 19)

COMPLETIONS_STREAM = _sse(
    [
        *(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 1,
                "model": "llama",
                "choices": [{"index": 0, "text": w, "logprobs": None, "finish_reason": None}],
            }
            for w in _WORDS
        ),
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": "llama",
            "choices": [],
            "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12},
        },
    ]
)

# OpenAI with include_usage: every chunk carries "usage": null, the last one the counts.
NULL_USAGE_STREAM = _sse(
    [
        *(_chat_chunk({"content": w}, usage=None) for w in _WORDS),
        _chat_chunk({}, finish="stop", usage=None),
        {"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7}},
    ]
)


def _responses_stream(eol: str = "\n") -> bytes:
    base = {"id": "resp_1", "object": "response", "created_at": 1, "model": "llama"}
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": {**base, "status": "in_progress", "usage": None}}),
        ("response.in_progress", {"response": {**base, "status": "in_progress", "usage": None}}),
        ("response.output_item.added", {"output_index": 0, "item": {"id": "msg_1"}}),
        ("response.content_part.added", {"item_id": "msg_1", "part": {"type": "output_text"}}),
        *(("response.output_text.delta", {"item_id": "msg_1", "delta": w}) for w in _WORDS),
        ("response.output_text.done", {"item_id": "msg_1", "text": "".join(_WORDS)}),
        ("response.completed", {"response": {**base, "status": "completed", "usage": {
            "input_tokens": 21,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 7,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 28,
        }}}),
    ]  # fmt: skip
    out = []
    for seq, (kind, body) in enumerate(events):
        payload = orjson.dumps({"type": kind, "sequence_number": seq, **body}).decode()
        out.append(f"event: {kind}{eol}data: {payload}{eol}{eol}")
    return "".join(out).encode()


RESPONSES_STREAM = _responses_stream()

NO_USAGE_STREAM = _sse(CHAT_EVENTS[:-1])  # role chunk + 7 content chunks + finish chunk

CHAT_JSON = orjson.dumps(
    {
        "id": "chatcmpl-2",
        "object": "chat.completion",
        "model": "llama",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello 世界"},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 9,
            "completion_tokens": 3,
            "total_tokens": 12,
            "prompt_tokens_details": None,
        },
    }
)
COMPLETIONS_JSON = orjson.dumps(
    {
        "id": "cmpl-2",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "Hi", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 16, "total_tokens": 20},
    }
)
RESPONSES_JSON = orjson.dumps(
    {
        "id": "resp_2",
        "object": "response",
        "status": "completed",
        "output": [{"type": "message", "content": [{"type": "output_text", "text": "Hi"}]}],
        "usage": {"input_tokens": 30, "output_tokens": 8, "total_tokens": 38},
    }
)


def _scan(chunks: Iterable[bytes], **kwargs: Any) -> UsageScanner:
    """Feed all chunks, then an empty end-of-stream chunk."""
    scanner = UsageScanner(**kwargs)
    for chunk in chunks:
        scanner.feed(chunk)
    scanner.feed(b"", end_of_stream=True)
    return scanner


def _split(body: bytes, cuts: Sequence[int]) -> list[bytes]:
    bounds = [0, *sorted(set(cuts)), len(body)]
    return [body[a:b] for a, b in pairwise(bounds)]


# --------------------------------------------------------------------------------------------
# SSE streams

SSE_CASES = [
    pytest.param(CHAT_STREAM, CHAT_USAGE, 10, id="chat"),
    pytest.param(COMPLETIONS_STREAM, Usage(5, 7, 12), 8, id="completions"),
    pytest.param(RESPONSES_STREAM, Usage(21, 7, 28), 13, id="responses-api"),
    pytest.param(CHAT_STREAM.replace(b"\n", b"\r\n"), CHAT_USAGE, 10, id="chat-crlf"),
    pytest.param(_responses_stream("\r\n"), Usage(21, 7, 28), 13, id="responses-crlf"),
    pytest.param(NULL_USAGE_STREAM, Usage(3, 7, 10), 9, id="usage-null-chunks"),
    pytest.param(b"\xef\xbb\xbf\n\n" + CHAT_STREAM, CHAT_USAGE, 10, id="bom-and-blank-lines"),
    pytest.param(b": keep-alive\n\n" + CHAT_STREAM, CHAT_USAGE, 10, id="comment-first"),
]


@pytest.mark.parametrize(("body", "expected", "events"), SSE_CASES)
def test_sse_whole_body(body: bytes, expected: Usage, events: int) -> None:
    scanner = _scan([body])
    assert scanner.sse is True
    assert scanner.usage == expected
    assert scanner.data_events == events
    assert scanner.output_tokens() == expected.completion_tokens


@pytest.mark.parametrize(("body", "expected", "events"), SSE_CASES)
def test_sse_split_at_every_offset(body: bytes, expected: Usage, events: int) -> None:
    for cut in range(len(body) + 1):
        scanner = _scan([body[:cut], body[cut:]])
        assert (scanner.usage, scanner.data_events) == (expected, events), f"cut at {cut}"


@pytest.mark.parametrize(("body", "expected", "events"), SSE_CASES)
def test_sse_byte_by_byte(body: bytes, expected: Usage, events: int) -> None:
    scanner = _scan(body[i : i + 1] for i in range(len(body)))
    assert scanner.usage == expected
    assert scanner.data_events == events


@pytest.mark.parametrize(
    ("body", "events", "fallback"),
    [
        pytest.param(NO_USAGE_STREAM, 9, 9, id="no-usage-counts-content-events"),
        pytest.param(
            _sse([_chat_chunk({"content": w}, usage=None) for w in _WORDS]),
            7,
            7,
            id="only-null-usage",
        ),
        pytest.param(
            _sse([*CHAT_EVENTS[:-1], {"choices": [], "usage": {"completion_tokens": "7"}}]),
            10,
            9,
            id="bad-usage-chunk-not-counted",
        ),
        pytest.param(
            _sse([_chat_chunk({"content": "x"})], done=False) + b"data:[DONE]\n",
            1,
            1,
            id="done-without-space",
        ),
        pytest.param(b"data: [DONE]\n\n", 0, 0, id="done-only"),
        pytest.param(b"", 0, 0, id="empty-body"),
    ],
)
def test_sse_fallback_estimate(body: bytes, events: int, fallback: int) -> None:
    scanner = _scan([body], sse=True)
    assert scanner.usage is None
    assert scanner.data_events == events
    assert scanner.output_tokens() == fallback


def test_last_usage_wins() -> None:
    """vLLM continuous_usage_stats: every chunk has cumulative usage; the last one counts."""
    body = _sse(
        [
            _chat_chunk({"content": "a"}, usage={"prompt_tokens": 4, "completion_tokens": 1}),
            _chat_chunk({"content": "b"}, usage={"prompt_tokens": 4, "completion_tokens": 2}),
            {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}},
        ]
    )
    assert _scan([body]).usage == Usage(4, 3, 7)
    assert _scan(_split(body, range(0, len(body), 7))).usage == Usage(4, 3, 7)


def test_invalid_later_usage_keeps_earlier_valid_one() -> None:
    body = _sse(
        [
            {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}},
            {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": -1}},
        ]
    )
    assert _scan([body]).usage == Usage(4, 3, 7)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(b'data: {"usage":{"prompt_tokens":1,"completion_tokens":2}}', Usage(1, 2, 3),
                     id="final-line-without-newline"),
        pytest.param(b'data:{"usage":{"prompt_tokens":1,"completion_tokens":2}}\n', Usage(1, 2, 3),
                     id="data-without-space"),
        pytest.param(b'data: {"usage":{"prompt_tokens":1,"completion_tokens":2}}\r\n',
                     Usage(1, 2, 3), id="crlf"),
        pytest.param(b'data: {"usage":null,"response":{"usage":{"input_tokens":1,'
                     b'"output_tokens":2}}}\n', Usage(1, 2, 3), id="null-usage-then-response"),
        pytest.param(b': {"usage":{"prompt_tokens":1,"completion_tokens":2}}\n', None,
                     id="comment-line-ignored"),
        pytest.param(b'event: x\nid: {"usage":{"prompt_tokens":1,"completion_tokens":2}}\n', None,
                     id="non-data-field-ignored"),
        pytest.param(b'event: x\n data: {"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n'
                     b'x data: {"usage":{"prompt_tokens":1,"completion_tokens":2}}\n', None,
                     id="data-not-at-line-start"),
        pytest.param(b'data: {"usage":{"prompt_tokens":1,"completion_tokens":2}\n', None,
                     id="truncated-json"),
        pytest.param(b'data: {"usage": {"prompt_tokens": 1, "completion_tokens": 2}} trailing\n',
                     None, id="trailing-garbage"),
        pytest.param(b'data: ["usage"]\n', None, id="json-array"),
        pytest.param(b'data: {"usage": "lots"}\n', None, id="usage-is-string"),
        pytest.param(b'data: {"response": {"usage": [1, 2]}}\n', None, id="usage-is-list"),
        pytest.param(b'data: {"response": "usage"}\n', None, id="usage-as-value"),
        pytest.param(b'data: {"usage":{"prompt_tokens":1,"completion_tokens":2}}\xff\xfe\n', None,
                     id="invalid-utf8"),
    ],
)  # fmt: skip
def test_sse_line_shapes(body: bytes, expected: Usage | None) -> None:
    assert _scan([body], sse=True).usage == expected


# --------------------------------------------------------------------------------------------
# Usage validation (wrong types never count)


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        pytest.param({"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
                     Usage(1, 2, 3), id="chat-names"),
        pytest.param({"input_tokens": 1, "output_tokens": 2, "total_tokens": 3},
                     Usage(1, 2, 3), id="responses-names"),
        pytest.param({"prompt_tokens": 1, "completion_tokens": 2}, Usage(1, 2, 3),
                     id="total-defaults-to-sum"),
        pytest.param({"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": None},
                     Usage(1, 2, 3), id="null-total-defaults-to-sum"),
        pytest.param({"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
                     Usage(0, 0, 0), id="zeros"),
        pytest.param({"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 99},
                     Usage(1, 2, 99), id="total-as-reported"),
        pytest.param({"prompt_tokens": 2**40, "completion_tokens": 2**40},
                     Usage(2**40, 2**40, 2**41), id="large"),
        pytest.param({"completion_tokens": "2", "prompt_tokens": 1}, None, id="string"),
        pytest.param({"completion_tokens": -2, "prompt_tokens": 1}, None, id="negative"),
        pytest.param({"completion_tokens": True, "prompt_tokens": 1}, None, id="bool"),
        pytest.param({"completion_tokens": 2.0, "prompt_tokens": 1}, None, id="float"),
        pytest.param({"completion_tokens": None, "prompt_tokens": 1}, None, id="null-count"),
        pytest.param({"prompt_tokens": 1}, None, id="missing-completion"),
        pytest.param({"completion_tokens": 2}, None, id="missing-prompt"),
        pytest.param({"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": -3}, None,
                     id="negative-total"),
        pytest.param({"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": "3"}, None,
                     id="string-total"),
        pytest.param({}, None, id="empty-object"),
        pytest.param(7, None, id="number"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("streaming", [True, False], ids=["sse", "json"])
def test_usage_validation(usage: object, expected: Usage | None, streaming: bool) -> None:
    doc = {"choices": [], "usage": usage}
    body = _sse([doc]) if streaming else orjson.dumps(doc)
    scanner = _scan([body])
    assert scanner.usage == expected
    assert isinstance(scanner.output_tokens(), int)
    assert scanner.output_tokens() >= 0


# --------------------------------------------------------------------------------------------
# Non-streaming JSON bodies

JSON_CASES = [
    pytest.param(CHAT_JSON, Usage(9, 3, 12), id="chat"),
    pytest.param(COMPLETIONS_JSON, Usage(4, 16, 20), id="completions"),
    pytest.param(RESPONSES_JSON, Usage(30, 8, 38), id="responses-api"),
    pytest.param(
        orjson.dumps({"response": {"usage": {"input_tokens": 1, "output_tokens": 2}}}),
        Usage(1, 2, 3),
        id="response-dot-usage",
    ),
    pytest.param(b"  \r\n" + CHAT_JSON + b"\n", Usage(9, 3, 12), id="surrounding-whitespace"),
    pytest.param(b"\xef\xbb\xbf" + CHAT_JSON, Usage(9, 3, 12), id="bom"),
    pytest.param(CHAT_JSON.replace(b',"usage":{', b',"nousage":{'), None, id="no-usage"),
    pytest.param(orjson.dumps({"usage": None}), None, id="null-usage"),
    pytest.param(CHAT_JSON[:-1], None, id="truncated"),
    pytest.param(b'["usage"]', None, id="array"),
    pytest.param(b'{"error": {"message": "bad", "type": "invalid_request_error"}}', None,
                 id="error-body"),
]  # fmt: skip


# What a body without usage is estimated at: its text's characters / 4, rounded up per text.
JSON_ESTIMATES = {"no-usage": 2, "null-usage": 0, "truncated": 0, "array": 0, "error-body": 0}


@pytest.mark.parametrize(("body", "expected"), JSON_CASES)
def test_json_body(body: bytes, expected: Usage | None, request: pytest.FixtureRequest) -> None:
    scanner = _scan([body])
    assert scanner.sse is False
    assert scanner.usage == expected
    assert scanner.data_events == 0
    assert scanner.estimated is (expected is None)
    if expected is not None:
        assert scanner.output_tokens() == expected.completion_tokens
    else:
        case = request.node.callspec.id
        assert scanner.output_tokens() == JSON_ESTIMATES[case]


def _without_usage(body: bytes) -> bytes:
    doc = orjson.loads(body)
    del doc["usage"]
    return orjson.dumps(doc)


@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        pytest.param(_without_usage(CHAT_JSON), 2, id="chat-message-content"),
        pytest.param(_without_usage(COMPLETIONS_JSON), 1, id="completions-text"),
        pytest.param(_without_usage(RESPONSES_JSON), 1, id="responses-output-text"),
        pytest.param(
            orjson.dumps({"choices": [{"text": "x" * 401}, {"text": "y" * 4}, {"text": ""}]}),
            101 + 1,
            id="each-choice-rounded-up-empty-ones-nothing",
        ),
        pytest.param(
            orjson.dumps({"choices": [{"message": {"content": None}}, 7, {"message": []}]}),
            0,
            id="no-text-anywhere",
        ),
    ],
)
def test_json_body_without_usage_is_estimated_from_its_text(body: bytes, tokens: int) -> None:
    scanner = _scan(_split(body, range(0, len(body), 9)))
    assert scanner.usage is None
    assert scanner.estimated
    assert scanner.output_tokens() == tokens


@pytest.mark.parametrize(("body", "expected"), JSON_CASES)
@pytest.mark.parametrize("step", [1, 3, 64], ids=["1B", "3B", "64B"])
def test_json_body_in_many_chunks(body: bytes, expected: Usage | None, step: int) -> None:
    assert _scan(_split(body, range(0, len(body), step))).usage == expected


@pytest.mark.parametrize(
    ("cap", "expected"),
    [
        pytest.param(len(CHAT_JSON), Usage(9, 3, 12), id="exactly-at-cap"),
        pytest.param(len(CHAT_JSON) - 1, None, id="one-byte-over-cap"),
        pytest.param(16, None, id="far-over-cap"),
    ],
)
@pytest.mark.parametrize("step", [7, 10_000], ids=["chunked", "one-chunk"])
def test_json_body_cap(cap: int, expected: Usage | None, step: int) -> None:
    scanner = _scan(_split(CHAT_JSON, range(0, len(CHAT_JSON), step)), max_buffer_bytes=cap)
    assert scanner.usage == expected
    assert scanner.output_tokens() == (expected.completion_tokens if expected else 0)


def test_json_usage_needs_end_of_stream() -> None:
    scanner = UsageScanner()
    scanner.feed(CHAT_JSON)
    assert scanner.usage is None
    scanner.feed(b"", end_of_stream=True)
    assert scanner.usage == Usage(9, 3, 12)


# --------------------------------------------------------------------------------------------
# Mode selection, caps, lifecycle


@pytest.mark.parametrize(
    ("body", "sse", "expected"),
    [
        pytest.param(CHAT_STREAM, False, None, id="sse-body-forced-json"),
        pytest.param(CHAT_JSON, True, None, id="json-body-forced-sse"),
        pytest.param(CHAT_STREAM, True, CHAT_USAGE, id="sse-forced-sse"),
        pytest.param(CHAT_JSON, False, Usage(9, 3, 12), id="json-forced-json"),
    ],
)
def test_forced_mode(body: bytes, sse: bool, expected: Usage | None) -> None:
    scanner = _scan([body], sse=sse)
    assert scanner.sse is sse
    assert scanner.usage == expected


@pytest.mark.parametrize(
    ("content_type", "expected"),
    [
        pytest.param("text/event-stream", True, id="sse"),
        pytest.param("Text/Event-Stream; charset=utf-8", True, id="sse-params-case"),
        pytest.param("application/json", False, id="json"),
        pytest.param("application/problem+json", False, id="json-suffix"),
        pytest.param("text/plain", None, id="other"),
        pytest.param("", None, id="empty"),
        pytest.param(None, None, id="missing"),
    ],
)
def test_sse_from_content_type(content_type: str | None, expected: bool | None) -> None:
    assert sse_from_content_type(content_type) is expected


def test_mode_undecided_until_content() -> None:
    scanner = UsageScanner()
    scanner.feed(b" \r\n\t")
    assert scanner.sse is None
    scanner.feed(b"\nda")
    assert scanner.sse is True


def test_over_long_sse_line_is_dropped_and_scanning_resumes() -> None:
    usage_line = b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}\n'
    huge = b'data: {"choices":[{"text":"' + b"a" * 5000 + b'"}]}\n\n'
    body = huge + usage_line + b"data: [DONE]\n"
    for step in (100, 4096):
        scanner = _scan(_split(body, range(0, len(body), step)), max_buffer_bytes=1024)
        assert scanner.usage == Usage(1, 2, 3), step
        assert scanner.data_events == 1, step  # the dropped line is not counted
    # The whole stream in one chunk needs no buffering, so the long line counts there.
    whole = _scan([body], max_buffer_bytes=1024)
    assert (whole.usage, whole.data_events) == (Usage(1, 2, 3), 2)


def test_partial_line_buffer_is_bounded() -> None:
    scanner = UsageScanner(max_buffer_bytes=100)
    for _ in range(1000):
        scanner.feed(b"data: " + b"x" * 50)
    assert len(scanner._buf) <= 100


def test_feed_after_end_of_stream_is_ignored() -> None:
    scanner = _scan([CHAT_STREAM])
    scanner.feed(b'data: {"usage":{"prompt_tokens":1,"completion_tokens":1}}\n', end_of_stream=True)
    assert scanner.usage == CHAT_USAGE
    assert scanner.data_events == 10


def test_final_line_needs_end_of_stream() -> None:
    scanner = UsageScanner()
    scanner.feed(b'data: {"usage":{"prompt_tokens":1,"completion_tokens":2}}')
    assert scanner.usage is None
    scanner.feed(b"", end_of_stream=True)
    assert scanner.usage == Usage(1, 2, 3)


def test_invalid_max_buffer_bytes() -> None:
    with pytest.raises(ValueError, match="max_buffer_bytes"):
        UsageScanner(max_buffer_bytes=0)


# --------------------------------------------------------------------------------------------
# Cost: only lines that carry usage are decoded


def _count_decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = usage_mod._json_loads

    def counting(payload: bytes | bytearray) -> Any:
        calls.append(len(payload))
        return real(payload)

    monkeypatch.setattr(usage_mod, "_json_loads", counting)
    return calls


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(
            _sse([*(_chat_chunk({"content": f"t{i}"}) for i in range(100)), CHAT_EVENTS[-1]]),
            CHAT_USAGE,
            id="vllm-usage-only-at-end",
        ),
        pytest.param(
            _sse(
                [
                    *(_chat_chunk({"content": f"t{i}"}, usage=None) for i in range(100)),
                    CHAT_EVENTS[-1],
                ]
            ),
            CHAT_USAGE,
            id="openai-usage-null-in-every-chunk",
        ),
    ],
)
@pytest.mark.parametrize("step", [1, 97, 4096, 1 << 20], ids=["1B", "97B", "4KiB", "whole"])
def test_only_usage_lines_are_decoded(
    monkeypatch: pytest.MonkeyPatch, body: bytes, expected: Usage, step: int
) -> None:
    calls = _count_decodes(monkeypatch)
    scanner = _scan(_split(body, range(0, len(body), step)))
    assert scanner.usage == expected
    assert scanner.data_events == 101
    assert len(calls) == 1


def test_continuous_usage_decodes_only_the_last_line_of_a_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = _sse(
        _chat_chunk({"content": "x"}, usage={"prompt_tokens": 1, "completion_tokens": i})
        for i in range(1, 51)
    )
    calls = _count_decodes(monkeypatch)
    assert _scan([body]).usage == Usage(1, 50, 51)
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("body", "decodes"),
    [
        pytest.param(CHAT_JSON, 1, id="with-usage"),
        # Decoded once too: its text is what the output is estimated from.
        pytest.param(CHAT_JSON.replace(b'"usage"', b'"nousage"'), 1, id="without-usage"),
    ],
)
def test_json_body_decoded_at_most_once(
    monkeypatch: pytest.MonkeyPatch, body: bytes, decodes: int
) -> None:
    calls = _count_decodes(monkeypatch)
    _scan(_split(body, range(0, len(body), 5)))
    assert len(calls) == decodes


# --------------------------------------------------------------------------------------------
# Properties

_FRAGMENTS = [
    b"data:", b"data: ", b"event: x", b": c", b"\n", b"\r\n", b"\r", b"{", b"}", b"[", b"]",
    b'"usage"', b":", b"null", b'"usage":null', b'"prompt_tokens"', b'"completion_tokens"',
    b'"output_tokens"', b'"response"', b",", b"1", b"-1", b"2.5", b"true", b"[DONE]", b"\xff",
    b"\xe4\xb8", b"\x96\xe7\x95\x8c", b" ", b"\xef\xbb\xbf",
]  # fmt: skip

_bodies = st.one_of(
    st.binary(max_size=400),
    st.lists(st.sampled_from(_FRAGMENTS) | st.binary(max_size=8), max_size=80).map(b"".join),
)


@settings(max_examples=300, deadline=None)
@given(
    body=_bodies,
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=20),
    sse=st.sampled_from([None, True, False]),
    cap=st.sampled_from([16, 64, 8 * 1024 * 1024]),
)
def test_arbitrary_bytes_never_raise(
    body: bytes, cuts: list[int], sse: bool | None, cap: int
) -> None:
    scanner = _scan(
        _split(body, [c for c in cuts if c <= len(body)]), sse=sse, max_buffer_bytes=cap
    )
    tokens = scanner.output_tokens()
    assert type(tokens) is int
    assert tokens >= 0
    assert scanner.data_events >= 0
    if scanner.usage is not None:
        assert min(scanner.usage.prompt_tokens, scanner.usage.completion_tokens) >= 0


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    body=st.sampled_from([CHAT_STREAM, COMPLETIONS_STREAM, RESPONSES_STREAM, NULL_USAGE_STREAM]),
)
def test_any_chunking_gives_the_same_result(data: st.DataObject, body: bytes) -> None:
    cuts = data.draw(st.lists(st.integers(min_value=0, max_value=len(body)), max_size=30))
    whole = _scan([body])
    split = _scan(_split(body, cuts))
    assert (split.usage, split.data_events) == (whole.usage, whole.data_events)
