"""Error mapping: status, OpenAI body, x-error header for every request error."""

from __future__ import annotations

import orjson
import pytest

from plugin.errors import (
    BadRequestBody,
    NoModel,
    NoReadyPod,
    RequestError,
    RoutingFailed,
    UnknownModel,
    UnknownStrategy,
    error_reply,
    error_type,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("err", "status", "etype", "code", "header", "message"),
    [
        pytest.param(
            BadRequestBody("request body is not valid JSON"),
            400,
            "invalid_request_error",
            None,
            ("x-error-request-body-processing", "true"),
            "request body is not valid JSON",
            id="bad-json",
        ),
        pytest.param(
            NoModel(),
            400,
            "invalid_request_error",
            "model_not_found",
            ("x-error-no-model-backends", "true"),
            "no model in request body",
            id="no-model",
        ),
        pytest.param(
            UnknownModel("llama"),
            400,
            "invalid_request_error",
            "model_not_found",
            ("x-error-no-model-backends", "llama"),
            "model llama does not exist",
            id="unknown-model",
        ),
        pytest.param(
            NoReadyPod("llama"),
            503,
            "overloaded_error",
            None,
            ("x-error-no-model-backends", "true"),
            "no ready pods for model llama",
            id="no-ready-pod",
        ),
        pytest.param(
            UnknownStrategy("fastest"),
            400,
            "invalid_request_error",
            None,
            ("x-error-routing", "true"),
            "incorrect routing strategy fastest",
            id="unknown-strategy",
        ),
        pytest.param(
            RoutingFailed("every pod excluded"),
            503,
            "overloaded_error",
            None,
            ("x-error-routing", "true"),
            "every pod excluded",
            id="routing-failed",
        ),
    ],
)
def test_error_reply(
    err: RequestError,
    status: int,
    etype: str,
    code: str | None,
    header: tuple[str, str],
    message: str,
) -> None:
    reply = error_reply(err)
    assert reply.status == status
    assert header in reply.headers
    assert ("content-type", "application/json") in reply.headers
    body = orjson.loads(reply.body)
    assert body == {"error": {"message": message, "type": etype, "param": err.param, "code": code}}


@pytest.mark.parametrize(
    ("status", "etype"),
    [
        (400, "invalid_request_error"),
        (404, "invalid_request_error"),
        (401, "authentication_error"),
        (429, "rate_limit_error"),
        (503, "overloaded_error"),
        (500, "api_error"),
        (502, "api_error"),
    ],
)
def test_error_type_by_status(status: int, etype: str) -> None:
    assert error_type(status) == etype


@pytest.mark.parametrize(
    ("model", "header"),
    [
        ("llama", "llama"),
        ("bad\r\nx-evil: 1", "badx-evil: 1"),
        ("\x00\x01", "invalid"),
        ("m" * 500, "m" * 128),
    ],
    ids=["plain", "crlf", "control-only", "long"],
)
def test_unknown_model_header_is_printable_and_short(model: str, header: str) -> None:
    reply = error_reply(UnknownModel(model))
    assert ("x-error-no-model-backends", header) in reply.headers
