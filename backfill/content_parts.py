"""Which chat content parts reach an engine: text, and media only where the deployment opts in.

A chat message's ``content`` may be an array of parts. vLLM takes media parts too
(``image_url``, ``video_url``, ``audio_url``, ``input_audio``, ``file``, embeddings...) and
fetches a media URL itself, from wherever it points, unless the engine was started with
``--allowed-media-domains``: a batch line or an interactive request pointing at a cloud
metadata address or at an internal service would make the engine fetch it. So by default a
part is accepted only as text, in batch and interactive chat alike.

A deployment whose engines serve a multimodal model and run with ``--allowed-media-domains``
opts in (``BACKFILL_MEDIA_PARTS``, for every tenant or those named in
``BACKFILL_MEDIA_TENANTS``). Then a media part is accepted within bounds (:class:`MediaPolicy`):
of the four kinds whose tokens the engine's multimodal processor counts; at most so many per
request and so many bytes of inline data (``data:`` URLs, ``input_audio``) per request; and a
media URL only over http(s) to a host the deployment names (``BACKFILL_MEDIA_ALLOWED_DOMAINS``,
the list its engines are started with: with none named, inline data alone). Its tokens are
counted, as every prompt's are, through the engine's own ``/tokenize`` of the whole chat
request (``backfill.prefill``), before anything is reserved.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from backfill.config import Settings

TEXT_PART_TYPES = frozenset({"text", "refusal"})
"""Part types that carry text alone (``refusal`` in an assistant message is text too)."""

MEDIA_URL_PARTS = ("image_url", "video_url", "audio_url")
"""Media parts given as ``{"type": T, T: {"url": ...}}``: an http(s) or ``data:`` URL."""
MEDIA_PART_TYPES = frozenset({*MEDIA_URL_PARTS, "input_audio"})
"""The media parts accepted with the opt-in: OpenAI's chat media parts (``input_audio``
carries base64 data inline) and vLLM's video and audio URLs. Embeddings, PIL images, files
and the rest are refused: their tokens are not what the processor counts from a URL, or
they name data Backfill does not hold."""


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """What media parts one tenant's chat requests may carry (see the module)."""

    allowed: bool = False
    domains: frozenset[str] = frozenset()
    """Hosts a media URL may name (lower case, exact, as vLLM's ``--allowed-media-domains``);
    empty: inline ``data:`` URLs only."""
    max_parts: int = 8
    max_inline_bytes: int = 10 << 20

    @classmethod
    def of(
        cls,
        enabled: bool,
        tenants: Iterable[str],
        tenant: tuple[str, str] | None,
        *,
        domains: Iterable[str],
        max_parts: int,
        max_inline_bytes: int,
    ) -> MediaPolicy:
        """The policy of ``tenant`` (its id and name; None: any tenant) on a deployment that
        opts in when ``enabled``, for every tenant or only those ``tenants`` names."""
        named = frozenset(t for t in tenants if t)
        allowed = enabled and (not named or (tenant is not None and bool(named & set(tenant))))
        return cls(
            allowed,
            frozenset(d.strip().lower() for d in domains if d.strip()),
            max_parts,
            max_inline_bytes,
        )


MEDIA_REFUSED = MediaPolicy()
"""No media part at all: the default."""


def tenant_media_policy(settings: Settings, tenant: tuple[str, str] | None) -> MediaPolicy:
    """The media policy of ``tenant`` (its id and name) under ``settings``."""
    return MediaPolicy.of(
        settings.media_parts,
        settings.media_tenants.split(","),
        tenant,
        domains=settings.media_allowed_domains.split(","),
        max_parts=settings.media_max_parts_per_request,
        max_inline_bytes=settings.media_max_inline_bytes_per_request,
    )


def media_part(
    messages: Sequence[Any], field: str = "messages", policy: MediaPolicy = MEDIA_REFUSED
) -> str | None:
    """A message naming the first content part of ``messages`` that ``policy`` refuses (or
    the bound a request's media parts break together), or None when every part passes."""
    parts = 0
    inline = 0
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in TEXT_PART_TYPES and isinstance(part.get("text", part.get("refusal")), str):
                continue
            where = f"{field}[{m}].content[{p}]"
            if not policy.allowed or kind not in MEDIA_PART_TYPES:
                return _not_accepted(where, kind, policy)
            assert isinstance(part, Mapping)
            assert isinstance(kind, str)
            size = _media_bytes(part, kind, policy, where)
            if isinstance(size, str):
                return size
            parts += 1
            inline += size
            if parts > policy.max_parts:
                return (
                    f"{where}: a request may carry at most {policy.max_parts} media parts "
                    "(BACKFILL_MEDIA_MAX_PARTS_PER_REQUEST)"
                )
            if inline > policy.max_inline_bytes:
                return (
                    f"{where}: a request's inline media (data: URLs, input_audio) may total at "
                    f"most {policy.max_inline_bytes} bytes "
                    "(BACKFILL_MEDIA_MAX_INLINE_BYTES_PER_REQUEST); this part passes that"
                )
    return None


def _not_accepted(where: str, kind: object, policy: MediaPolicy) -> str:
    what = f"a part of type {kind!r}" if isinstance(kind, str) else "not a text part"
    if not policy.allowed:
        return (
            f"{where} is {what}: only text parts are accepted (an engine would fetch a media "
            "part's URL itself; this deployment does not accept media parts)"
        )
    kinds = ", ".join(sorted(MEDIA_PART_TYPES))
    return f"{where} is {what}: only text parts and media parts of type {kinds} are accepted"


def _media_bytes(part: Mapping[str, Any], kind: str, policy: MediaPolicy, where: str) -> int | str:
    """The inline bytes ``part`` carries (0 for a URL to an allowed host), or why it is
    refused."""
    if kind == "input_audio":
        audio = part.get("input_audio")
        data = audio.get("data") if isinstance(audio, Mapping) else None
        if not isinstance(data, str) or not data:
            return f"{where}.input_audio.data must be a non-empty base64 string"
        return len(data)
    holder = part.get(kind)
    url = holder.get("url") if isinstance(holder, Mapping) else None
    if not isinstance(url, str) or not url:
        return f"{where}.{kind}.url must be a non-empty string"
    try:
        split = urlsplit(url)
        host = split.hostname
    except ValueError:
        return f"{where}.{kind}.url is not a valid URL"
    scheme = split.scheme.lower()
    if scheme == "data":
        return len(url)
    if scheme not in ("http", "https"):
        return f"{where}.{kind}.url must be an http(s) or data: URL, not {scheme or 'none'!r}"
    if not policy.domains:
        return (
            f"{where}.{kind}.url names a host; this deployment accepts media inline only "
            "(data: URLs): no host is named in BACKFILL_MEDIA_ALLOWED_DOMAINS"
        )
    if host is None or host.lower() not in policy.domains:
        return (
            f"{where}.{kind}.url names host {host!r}, which is not among the hosts this "
            f"deployment fetches media from ({', '.join(sorted(policy.domains))})"
        )
    return 0
