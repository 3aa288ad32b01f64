"""Media content parts in chat requests: refused unless the deployment opts in, and with the
opt-in accepted within bounds (kinds, hosts, parts and inline bytes per request), per tenant
(pure, no services)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from backfill.batch_input import InputLimits, InvalidBatch, ValidatedBatch, validate_batch_input
from backfill.config import Settings
from backfill.content_parts import MEDIA_REFUSED, MediaPolicy, media_part, tenant_media_policy
from backfill.gateway.request import InteractiveEndpoint, parse_request
from backfill.refusals import InvalidRequest
from tests.unit.support_limits import BATCH_LIMITS

CHAT = "/v1/chat/completions"
PNG = "data:image/png;base64," + "iVBORw0KGgo" * 10
OPEN = MediaPolicy(allowed=True, domains=frozenset({"images.example.com"}))
LIMITS = dataclasses.replace(BATCH_LIMITS, max_line_bytes=1_000_000)


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def messages(*parts: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "describe"}, *parts]}]


def test_every_media_part_is_refused_by_default_naming_it() -> None:
    refused = media_part(messages(image(PNG)))
    assert refused is not None
    assert refused.startswith("messages[0].content[1] is a part of type 'image_url'")
    assert "does not accept media parts" in refused


@pytest.mark.parametrize(
    "part",
    [
        image(PNG),
        image("https://images.example.com/cat.png"),
        image("HTTPS://IMAGES.EXAMPLE.COM/cat.png"),
        {"type": "video_url", "video_url": {"url": "https://images.example.com/v.mp4"}},
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,UklGRg=="}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    ],
)
def test_with_the_opt_in_media_inline_or_from_a_named_host_is_accepted(part: Any) -> None:
    assert media_part(messages(part), policy=OPEN) is None


@pytest.mark.parametrize(
    ("part", "says"),
    [
        # The hosts the engine would fetch from on a caller's word.
        (image("http://169.254.169.254/latest/meta-data/"), "host '169.254.169.254'"),
        (image("http://127.0.0.1:6379/"), "host '127.0.0.1'"),
        (image("https://images.example.com.evil.net/x.png"), "is not among the hosts"),
        (image("file:///etc/passwd"), "must be an http(s) or data: URL, not 'file'"),
        (image("images.example.com/x.png"), "not 'none'"),
        (image(""), "image_url.url must be a non-empty string"),
        ({"type": "image_url", "image_url": "https://images.example.com/x"}, "url must be"),
        ({"type": "input_audio", "input_audio": {"data": ""}}, "input_audio.data must be"),
        # Kinds whose tokens are not a URL's or whose data Backfill does not hold.
        ({"type": "file", "file": {"file_id": "f"}}, "media parts of type audio_url"),
        ({"type": "image_embeds", "image_embeds": "AAAA"}, "a part of type 'image_embeds'"),
        ({"type": "text"}, "a part of type 'text'"),
    ],
)
def test_with_the_opt_in_a_part_out_of_bounds_is_refused_naming_why(part: Any, says: str) -> None:
    refused = media_part(messages(part), "body.messages", OPEN)
    assert refused is not None
    assert refused.startswith("body.messages[0].content[1]")
    assert says in refused


def test_with_no_host_named_only_inline_media_is_accepted() -> None:
    inline_only = MediaPolicy(allowed=True)
    assert media_part(messages(image(PNG)), policy=inline_only) is None
    refused = media_part(messages(image("https://images.example.com/x.png")), policy=inline_only)
    assert refused is not None
    assert "BACKFILL_MEDIA_ALLOWED_DOMAINS" in refused


def test_a_request_may_carry_so_many_media_parts_and_so_many_inline_bytes() -> None:
    few = dataclasses.replace(OPEN, max_parts=2, max_inline_bytes=len(PNG) * 2)
    assert media_part(messages(image(PNG), image(PNG)), policy=few) is None
    # The bound is the request's, over all its messages.
    many = [*messages(image(PNG)), *messages(image("https://images.example.com/a"))]
    many += messages(image("https://images.example.com/b"))
    refused = media_part(many, policy=few)
    assert refused is not None
    assert refused.startswith("messages[2].content[1]: a request may carry at most 2 media")
    light = dataclasses.replace(OPEN, max_inline_bytes=len(PNG))
    assert media_part(messages(image(PNG)), policy=light) is None
    audio = {"type": "input_audio", "input_audio": {"data": "A"}}
    heavy = media_part(messages(image(PNG), audio), policy=light)
    assert heavy is not None
    assert "inline media" in heavy
    assert "content[2]" in heavy


def test_the_opt_in_is_for_every_tenant_or_the_tenants_named_by_id_or_name() -> None:
    base = Settings(media_parts=True, media_allowed_domains=" Images.Example.com ,")
    assert tenant_media_policy(base, ("t1", "acme")).allowed
    assert tenant_media_policy(base, ("t1", "acme")).domains == frozenset({"images.example.com"})
    named = base.model_copy(update={"media_tenants": "acme,t9"})
    assert tenant_media_policy(named, ("t1", "acme")).allowed
    assert tenant_media_policy(named, ("t9", "other")).allowed
    assert not tenant_media_policy(named, ("t2", "other")).allowed
    assert not tenant_media_policy(Settings(), ("t1", "acme")).allowed
    assert InputLimits.from_settings(base).media == MEDIA_REFUSED
    assert InputLimits.from_settings(base, ("t1", "acme")).media.allowed


def chat_line(*parts: Any) -> bytes:
    body = {"model": "m", "messages": messages(*parts), "max_tokens": 10}
    return json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": body}).encode()


def test_a_batch_line_with_media_is_stored_as_given_only_with_the_opt_in() -> None:
    content = chat_line(image(PNG)) + b"\n"
    refused = validate_batch_input(content, CHAT, LIMITS)
    assert isinstance(refused, InvalidBatch)
    assert refused.errors[0].message.startswith("body.messages[0].content[1] is a part")
    accepted = validate_batch_input(content, CHAT, dataclasses.replace(LIMITS, media=OPEN))
    assert isinstance(accepted, ValidatedBatch)
    [item] = accepted.items
    assert json.loads(item.body or "")["messages"][0]["content"][1] == image(PNG)
    far = validate_batch_input(
        chat_line(image("http://10.0.0.1/x.png")) + b"\n",
        CHAT,
        dataclasses.replace(LIMITS, media=OPEN),
    )
    assert isinstance(far, InvalidBatch)
    assert (far.errors[0].code, far.errors[0].param) == ("invalid_messages", "body.messages")
    assert "host '10.0.0.1'" in far.errors[0].message


def test_an_interactive_chat_with_media_is_counted_exactly_only_with_the_opt_in() -> None:
    body = {"model": "m", "messages": messages(image(PNG))}
    with pytest.raises(InvalidRequest) as refused:
        parse_request(InteractiveEndpoint.CHAT_COMPLETIONS, body)
    assert refused.value.param == "messages"
    shape = parse_request(InteractiveEndpoint.CHAT_COMPLETIONS, body, OPEN)
    # Never admitted on the text's bound: the engine's /tokenize counts the media's tokens.
    assert shape.bound_key is None
    with pytest.raises(InvalidRequest) as far:
        parse_request(
            InteractiveEndpoint.CHAT_COMPLETIONS,
            {"model": "m", "messages": messages(image("http://169.254.169.254/"))},
            OPEN,
        )
    assert "host '169.254.169.254'" in far.value.message
