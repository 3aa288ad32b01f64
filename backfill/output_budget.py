"""The output budget of a batch line that gives none.

OpenAI and vLLM, given no ``max_tokens``, generate up to what the model's context leaves the
prompt. Backfill reserves a worst case before any engine work, so such a line may generate
what the class limit (the model's context at most, on a node) leaves its prompt, and no more
than ``BACKFILL_BATCH_DEFAULT_MAX_TOKENS``; a prompt that fits is never refused for the
default. One rule, applied twice:

* at ingest (``backfill.batch_input``), on the prompt's lower bound: the budget the item is
  stored with and forecast by (the default, or less where the prompt leaves less);
* at each run (``backfill.dispatch.checks``), on the engine's exact count: what is left of the
  stored budget, cut to what the limit leaves the prompt, written into the request in the
  field the engine obeys, so the reservation covers exactly what the engine may generate.

A line that gives its own budget keeps it: over the limit, it fails. Pure functions over
values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backfill.prefill import CHAT, RESPONSES


def fitted_output(cap: int, limit: int, prompt_tokens: int) -> int:
    """What one sequence of ``prompt_tokens`` may generate under ``limit`` tokens (prompt and
    output), at most ``cap``: below 1 where the prompt leaves no room."""
    return min(cap, limit - prompt_tokens)


def budget_field(endpoint: str, request: Mapping[str, Any]) -> str:
    """The field of ``request`` that the engine takes its output budget from: vLLM's chat
    request reads ``max_completion_tokens`` before ``max_tokens``."""
    if endpoint == RESPONSES:
        return "max_output_tokens"
    if endpoint == CHAT and request.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return "max_tokens"


def with_output_budget(
    endpoint: str, request: Mapping[str, Any], max_output: int
) -> dict[str, Any]:
    """A copy of ``request`` whose output budget is ``max_output``."""
    fitted = dict(request)
    fitted[budget_field(endpoint, request)] = max_output
    return fitted
