"""Optional API-key authentication, shared by the gRPC and HTTP surfaces.

Clients send `authorization: Bearer <key>` (gRPC metadata or HTTP header, as the OpenAI clients do).
The comparison is constant-time (`hmac.compare_digest` on the UTF-8 bytes), so response timing says
nothing about how much of a guess was right. Without a configured key every request is accepted.
The key itself comes from DDTREE_API_KEY, read by the CLI only.
"""

from __future__ import annotations

import hmac

from gateway.errors import GatewayError


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` value (scheme case-insensitive), else None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def check_api_key(expected: str | None, authorization: str | None) -> None:
    """Raise UNAUTHENTICATED unless no key is configured or the header carries it."""
    if expected is None:
        return
    token = bearer_token(authorization)
    if token is None:
        raise GatewayError("UNAUTHENTICATED", "missing API key: send 'authorization: Bearer <key>'")
    if not hmac.compare_digest(token.encode("utf-8"), expected.encode("utf-8")):
        raise GatewayError("UNAUTHENTICATED", "invalid API key")
