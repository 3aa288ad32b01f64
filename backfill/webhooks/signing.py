"""Standard Webhooks signatures, made exactly as OpenAI makes them.

A secret is ``whsec_`` and the base64 of 32 random bytes; the HMAC key is those bytes. The
signature is ``v1,`` and the base64 of HMAC-SHA256 over ``{webhook-id}.{timestamp}.{body}``;
while a rotated secret is still honoured, each active secret signs and the header carries
the signatures separated by spaces (any one matching verifies). ``openai``'s
``client.webhooks.unwrap(body, headers, secret=...)`` checks these headers.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Sequence

SECRET_PREFIX = "whsec_"  # noqa: S105 - the prefix, not a secret


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def secret_hint(secret: str) -> str:
    """A masked secret, enough to tell two apart (``signing_secret_hint``)."""
    return f"{SECRET_PREFIX}...{secret[-4:]}"


def _key(secret: str) -> bytes:
    if secret.startswith(SECRET_PREFIX):
        return base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    return secret.encode()


def signature(secret: str, webhook_id: str, timestamp: int, body: bytes) -> str:
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    digest = hmac.new(_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signed_headers(
    secrets_: Sequence[str], webhook_id: str, timestamp: int, body: bytes
) -> dict[str, str]:
    """The headers of one attempt: the id (the same on every attempt), the time of this
    attempt (receivers refuse one more than a few minutes off their clock) and the
    signatures."""
    return {
        "webhook-id": webhook_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(signature(s, webhook_id, timestamp, body) for s in secrets_),
    }
