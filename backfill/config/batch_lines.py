"""What one batch line may carry (prompts, a default `max_tokens`, media parts) and whether a
batch for a model no live node serves may wait."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from backfill.config.fields import PositiveFloat, PositiveInt


class BatchLineSettings(BaseModel):
    """A batch line's shape, its media, and the model it names."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    batch_max_prompts_per_line: PositiveInt = 64
    """prompts one completions batch line (inputs one embeddings line) may carry (each is a
    sequence, counted and reserved)"""
    batch_default_max_tokens: PositiveInt = 2048
    """the most a batch line that sets no max_tokens (`max_output_tokens` on `/v1/responses`)
    may generate: it gets what the batch limit (the model's context at most) leaves its prompt,
    at most this (reserved, and sent to the engine); never a refusal for a prompt that fits.
    OpenAI does not require the field, Backfill must reserve a worst case
    (`backfill.output_budget`)"""
    media_parts: bool = False
    """accept media content parts (`image_url`, `video_url`, `audio_url`, `input_audio`) in
    batch and interactive chat. Off, a media part is a 400 naming it (the engine would fetch its
    URL itself). Their tokens are counted by the engine's `/tokenize` of the whole request,
    before any reservation: it needs a vLLM whose `/tokenize` runs the multimodal processor"""
    media_tenants: str = ""
    """with media on, only the tenants named (ids or names, comma-separated) may send it; empty:
    every tenant"""
    media_allowed_domains: str = ""
    """a media URL must be http(s) to one of the hosts named (comma-separated, exact, as vLLM's
    `--allowed-media-domains`: start every engine with the same list), none named: inline
    `data:` media only"""
    media_max_parts_per_request: PositiveInt = 8
    """with media on, the media parts one request (one batch line) may carry"""
    media_max_inline_bytes_per_request: PositiveInt = 10 << 20
    """with media on, the bytes of inline media (`data:` URLs, `input_audio`) one request may
    carry, all of them together"""
    batch_wait_for_model: bool = False
    """let a batch for a model no live node serves wait (else 404 `model_not_found` while any
    node is live)"""
    node_live_s: PositiveFloat = 600.0
    """how recently a node must have been seen to count as live"""
