"""AIBrix's gateway API key (`AIBRIX_AUTH_BEARER_TOKEN`): one shared bearer token, checked on
every request when it is set.

As AIBrix's gateway does it (`pkg/plugins/gateway`, `isAuthorized`/`extractBearerToken`): the
`Authorization` header must read `Bearer <token>` (the scheme in any case, surrounding spaces
ignored), and the two tokens are compared as SHA-256 digests in constant time, so neither the
comparison's time nor its length gives the token away. The token is never logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["BearerToken", "bearer_token"]


class BearerToken:
    """The configured token, kept only as its digest."""

    __slots__ = ("_digest",)

    def __init__(self, token: str) -> None:
        token = token.strip()
        if not token:
            raise ValueError("an empty bearer token would let every request in")
        self._digest = hashlib.sha256(token.encode()).digest()

    def __repr__(self) -> str:
        return "BearerToken(<hidden>)"

    def authorizes(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header value carries the token."""
        token = bearer_token(authorization)
        if token is None:
            return False
        given = hashlib.sha256(token.encode()).digest()
        return hmac.compare_digest(given, self._digest)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header value (the scheme in any case,
    surrounding spaces ignored); None for another scheme or an empty token."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None
