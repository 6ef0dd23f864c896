"""The gateway API key (AIBRIX_AUTH_BEARER_TOKEN): what passes, what does not, nothing leaks."""

from __future__ import annotations

import orjson
import pytest

from plugin.core.auth import BearerToken
from plugin.errors import Unauthorized, error_reply

pytestmark = pytest.mark.unit

TOKEN = "tok-123"


@pytest.mark.parametrize(
    "header", ["Bearer tok-123", "bearer tok-123", "  BEARER   tok-123  ", "Bearer\ttok-123"]
)
def test_the_token_in_a_bearer_header_passes(header: str) -> None:
    # A tab after the scheme is not a space: AIBrix splits on one space only.
    assert BearerToken(TOKEN).authorizes(header) is (header != "Bearer\ttok-123")


@pytest.mark.parametrize(
    "header",
    [None, "", "Bearer", "Bearer ", "Basic tok-123", "tok-123", "Bearer tok-1234", "Bearer tok"],
)
def test_anything_else_is_refused(header: str | None) -> None:
    assert BearerToken(TOKEN).authorizes(header) is False


def test_an_empty_token_is_refused_and_the_token_is_never_shown() -> None:
    with pytest.raises(ValueError):
        BearerToken("  ")
    token = BearerToken(" secret-value ")
    assert token.authorizes("Bearer secret-value")
    assert "secret" not in repr(token)


def test_the_refusal_is_a_401_in_openai_shape() -> None:
    reply = error_reply(Unauthorized())
    assert reply.status == 401
    error = orjson.loads(reply.body)["error"]
    assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
    assert ("x-error-auth", "true") in reply.headers
