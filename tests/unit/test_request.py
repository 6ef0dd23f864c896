"""Request parsing: what the strategies see of a body and its headers, table-driven."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from plugin.core.request import (
    CharRatioTokenizer,
    models_list,
    parse_request,
    parse_slo,
    with_usage_requested,
)
from plugin.core.types import SloTarget
from plugin.errors import BadRequestBody, BadRequestHeader, NoModel, RequestError, error_reply

pytestmark = pytest.mark.unit


def parse(doc: dict[str, Any], **kw: Any) -> Any:
    return parse_request(orjson.dumps({"model": "m", **doc}), "r1", **kw)


@pytest.mark.parametrize(
    ("doc", "chars", "tokens"),
    [
        ({"messages": [{"role": "user", "content": "hello world!"}]}, 12, 3),
        (
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "12345"},
                ]
            },
            13,
            2 + 2,  # each message rounds up on its own
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "abcd"},
                            {"type": "image_url", "image_url": {"url": "data:..."}},
                            {"type": "text", "text": "efgh"},
                        ],
                    }
                ]
            },
            8,
            2,
        ),
        ({"messages": [{"role": "assistant", "content": None}, "junk", 7]}, 0, 0),
        ({"prompt": "a" * 10}, 10, 3),
        ({"prompt": ["abcd", "ef"]}, 6, 2),
        ({"prompt": [1, 2, 3, 4, 5]}, 0, 5),
        ({"prompt": [[1, 2], [3, 4, 5]]}, 0, 5),
        ({"prompt": {"not": "a prompt"}}, 0, 0),
        ({}, 0, 0),
        ({"input": "abcdefgh"}, 8, 2),
        (
            {
                "instructions": "be brief",
                "input": [
                    {"role": "user", "content": [{"type": "input_text", "text": "abcd"}]},
                    {"type": "message", "role": "assistant", "content": "ef"},
                    {"type": "function_call_output", "output": "not prompt text here"},
                ],
            },
            14,
            4,
        ),
        ({"input": [{"content": "abcd"}], "instructions": 7}, 4, 1),
    ],
    ids=[
        "chat-string",
        "chat-two-messages",
        "chat-text-parts",
        "chat-junk-ignored",
        "completion-string",
        "completion-strings",
        "completion-token-ids",
        "completion-token-id-batches",
        "completion-bad-prompt",
        "no-prompt",
        "responses-string-input",
        "responses-instructions-and-items",
        "responses-bad-instructions-ignored",
    ],
)
def test_prompt_size(doc: dict[str, Any], chars: int, tokens: int) -> None:
    info = parse(doc)
    assert (info.prompt_chars, info.prompt_tokens) == (chars, tokens)


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ({"max_tokens": 64}, 64),
        ({"max_completion_tokens": 32, "max_tokens": 64}, 32),
        ({"max_completion_tokens": 0, "max_tokens": 64}, 64),
        ({"max_tokens": -1}, None),
        ({"max_tokens": True}, None),
        ({"max_tokens": "64"}, None),
        ({"max_tokens": 6.5}, None),
        ({"max_output_tokens": 16}, 16),
        ({}, None),
    ],
    ids=[
        "max-tokens",
        "completion-wins",
        "zero-falls-back",
        "negative",
        "bool",
        "str",
        "float",
        "responses-max-output-tokens",
        "none",
    ],
)
def test_max_tokens(doc: dict[str, Any], expected: int | None) -> None:
    assert parse(doc).max_tokens == expected


def test_everything_else_the_request_carries() -> None:
    slo = SloTarget(0.5, 0.05)
    body = orjson.dumps(
        {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "prompt": "x"}
    )
    info = parse_request(body, "req-9", arrived_at=12.5, slo=slo)
    assert (info.model, info.stream, info.include_usage) == ("m", True, True)
    assert (info.body_bytes, info.request_id, info.arrived_at, info.slo) == (
        len(body),
        "req-9",
        12.5,
        slo,
    )


def test_the_tokenizer_is_a_seam() -> None:
    @dataclass(frozen=True)
    class Words:
        def count(self, text: str) -> int:
            return len(text.split())

    info = parse({"messages": [{"role": "user", "content": "one two three"}]}, tokenizer=Words())
    assert info.prompt_tokens == 3
    assert CharRatioTokenizer(2.0).count("abcde") == 3


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"{not json", BadRequestBody),
        (b"[1, 2]", BadRequestBody),
        (b"", BadRequestBody),
        (b'{"messages": []}', NoModel),
        (b'{"model": ""}', NoModel),
        (b'{"model": 7}', NoModel),
    ],
    ids=["not-json", "not-object", "empty", "no-model", "empty-model", "model-not-string"],
)
def test_bad_bodies(body: bytes, error: type[RequestError]) -> None:
    with pytest.raises(error):
        parse_request(body)


@pytest.mark.parametrize(
    ("ttft", "tpot", "expected"),
    [
        (None, None, None),
        ("", "  ", None),
        ("500", None, SloTarget(0.5, None)),
        (None, "40", SloTarget(None, 0.04)),
        ("250.5", "8", SloTarget(0.2505, 0.008)),
    ],
    ids=["absent", "blank", "ttft", "tpot", "both"],
)
def test_slo_headers(ttft: str | None, tpot: str | None, expected: SloTarget | None) -> None:
    assert parse_slo(ttft, tpot) == expected


@pytest.mark.parametrize("value", ["soon", "0", "-3", "nan", "inf", "1e999"])
def test_a_malformed_slo_header_is_a_400_naming_it(value: str) -> None:
    with pytest.raises(BadRequestHeader) as err:
        parse_slo(None, value)
    reply = error_reply(err.value)
    doc = orjson.loads(reply.body)["error"]
    assert reply.status == 400
    assert (doc["param"], doc["type"]) == ("x-slo-tpot-ms", "invalid_request_error")
    assert ("x-error-request-header-processing", "true") in reply.headers


def test_models_list_is_openai_shaped() -> None:
    doc = orjson.loads(models_list(["a", "b"]))
    assert doc["object"] == "list"
    assert [m["id"] for m in doc["data"]] == ["a", "b"]


@given(st.binary(max_size=300))
def test_any_bytes_parse_or_raise_a_request_error(body: bytes) -> None:
    try:
        info = parse_request(body)
    except RequestError:
        return
    assert info.prompt_chars >= 0 and info.prompt_tokens >= 0
    assert info.max_tokens is None or info.max_tokens > 0


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)  # what JSON engines exchange
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)


@given(messages=JSON, prompt=JSON, max_tokens=JSON)
def test_any_json_shape_parses(messages: Any, prompt: Any, max_tokens: Any) -> None:
    info = parse({"messages": messages, "prompt": prompt, "max_tokens": max_tokens})
    assert info.prompt_chars >= 0 and info.prompt_tokens >= 0
    assert info.max_tokens is None or info.max_tokens > 0


def _asked(body: bytes) -> bytes | None:
    return with_usage_requested(body, parse_request(body))


@pytest.mark.parametrize(
    ("doc", "options"),
    [
        pytest.param({"stream": True}, {"include_usage": True}, id="no-options"),
        pytest.param(
            {"stream": True, "stream_options": {"include_usage": False}},
            {"include_usage": True},
            id="declined-usage-is-asked-for-and-taken-out-again",
        ),
        pytest.param(
            {"stream": True, "stream_options": {"other": 1}},
            {"other": 1, "include_usage": True},
            id="other-options-kept",
        ),
        pytest.param(
            {"stream": True, "stream_options": None},
            {"include_usage": True},
            id="null-options",
        ),
        pytest.param(
            {"stream": True, "messages": [{"role": "user", "content": '"stream_options"'}]},
            {"include_usage": True},
            id="the-name-in-a-prompt-takes-the-slow-path",
        ),
    ],
)
def test_a_stream_that_did_not_ask_for_usage_is_made_to(
    doc: dict[str, Any], options: dict[str, Any]
) -> None:
    original = {"model": "m", "max_tokens": 3, **doc}
    body = b"  \n" + orjson.dumps(original)
    rewritten = _asked(body)
    assert rewritten is not None
    assert orjson.loads(rewritten) == {**original, "stream_options": options}


@pytest.mark.parametrize(
    "doc",
    [
        pytest.param({"stream": False}, id="not-streamed"),
        pytest.param({}, id="stream-absent"),
        pytest.param({"stream": True, "stream_options": {"include_usage": True}}, id="asked"),
        pytest.param(
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            id="continuous-usage-would-show-in-every-chunk",
        ),
    ],
)
def test_other_requests_are_left_as_they_are(doc: dict[str, Any]) -> None:
    assert _asked(orjson.dumps({"model": "m", **doc})) is None
