"""Webhook signing secrets sealed at rest.

A signing secret must be at hand, in clear, to sign each delivery (an HMAC key cannot be
stored as a hash), so Postgres keeps it encrypted with a key Postgres never sees: Fernet
(AES-128-CBC with HMAC-SHA256, from ``cryptography``) under the keys of
``BACKFILL_WEBHOOKS_SECRET_KEYS``, comma-separated, the first sealing and every one opening
(a key is rotated by putting the new one first: the sender reseals what the old one sealed,
and the old one can go once that is done). A stored value says how it is kept: ``sealed:``
and a Fernet token, or the secret itself, as secrets were kept before sealing (and still are
where no key is set, with a warning at start); the sender seals those as soon as keys are set.
A dump of the database, a replica or a backup then holds no secret that signs.
"""

from __future__ import annotations

from collections.abc import Sequence

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

SEALED = "sealed:"
KEYS_VARIABLE = "BACKFILL_WEBHOOKS_SECRET_KEYS"
CLEAR_SECRETS_WARNING = (
    f"webhook signing secrets are stored in clear: set {KEYS_VARIABLE} (a key from "
    "`backfill webhooks new-key`) to seal them at rest"
)


class SecretKeyError(ValueError):
    """A key in ``BACKFILL_WEBHOOKS_SECRET_KEYS`` is not a Fernet key."""


class UnsealError(RuntimeError):
    """A stored secret cannot be opened with the keys at hand."""


def new_key() -> str:
    """A fresh key for ``BACKFILL_WEBHOOKS_SECRET_KEYS``."""
    return Fernet.generate_key().decode()


def parse_keys(value: str) -> tuple[str, ...]:
    """The keys of a ``BACKFILL_WEBHOOKS_SECRET_KEYS`` value, each checked."""
    keys = tuple(k.strip() for k in value.split(",") if k.strip())
    for n, key in enumerate(keys, start=1):
        try:
            Fernet(key)
        except ValueError:
            raise SecretKeyError(
                f"{KEYS_VARIABLE}: key {n} of {len(keys)} is not a Fernet key (32 bytes, "
                "url-safe base64; make one with `backfill webhooks new-key`)"
            ) from None
    return keys


class SecretSeal:
    """Seals and opens stored signing secrets under the deployment's keys (none: clear)."""

    def __init__(self, keys: Sequence[str] = ()) -> None:
        self._keys = tuple(keys)
        self._primary = Fernet(self._keys[0]) if self._keys else None
        self._all = MultiFernet([Fernet(k) for k in self._keys]) if self._keys else None

    @property
    def sealing(self) -> bool:
        return self._primary is not None

    def seal(self, secret: str) -> str:
        """What to store for ``secret``."""
        if self._primary is None:
            return secret
        return SEALED + self._primary.encrypt(secret.encode()).decode()

    def open(self, stored: str) -> str:
        """The secret ``stored`` keeps."""
        if not stored.startswith(SEALED):
            return stored
        if self._all is None:
            raise UnsealError(
                f"a webhook secret is sealed and {KEYS_VARIABLE} is not set: set the keys it "
                "was sealed with"
            )
        try:
            return self._all.decrypt(stored.removeprefix(SEALED).encode()).decode()
        except InvalidToken:
            raise UnsealError(
                f"a webhook secret was sealed with a key {KEYS_VARIABLE} no longer holds"
            ) from None

    def reseal(self, stored: str) -> str | None:
        """``stored`` sealed under the first key, or None where it already is (or where no
        key is set)."""
        if self._primary is None or self._all is None:
            return None
        if not stored.startswith(SEALED):
            return self.seal(stored)
        token = stored.removeprefix(SEALED).encode()
        try:
            self._primary.decrypt(token)
            return None
        except InvalidToken:
            pass
        try:
            return SEALED + self._all.rotate(token).decode()
        except InvalidToken:
            raise UnsealError(
                f"a webhook secret was sealed with a key {KEYS_VARIABLE} no longer holds"
            ) from None
