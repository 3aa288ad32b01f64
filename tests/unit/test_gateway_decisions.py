"""The gateway's pure decisions: request shape, the cheap bound and the exact check, the
upstream body, node ranking, the wait budget, and the engine-observed non-batch estimate."""

from __future__ import annotations

from typing import Any

import pytest

from backfill.gateway.placement import NodeLoad, rank_nodes, wait_budget_s
from backfill.gateway.refusals import ContextLengthExceeded, OverRequestCap
from backfill.gateway.request import (
    BOUND_MARGIN_PER_SEGMENT,
    InteractiveEndpoint,
    bound_key,
    parse_request,
    prompt_upper_bound,
)
from backfill.gateway.sizing import (
    check_bound,
    check_sequences,
    prompt_lower_bound,
    size_request,
    upstream_body,
)
from backfill.ledger import Lease
from backfill.observe import allocated_tokens, batch_physical_tokens, observed_non_batch
from backfill.policy import ServiceClass
from backfill.refusals import InvalidRequest

CHAT = InteractiveEndpoint.CHAT_COMPLETIONS
COMPLETIONS = InteractiveEndpoint.COMPLETIONS


def chat(content: Any = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data/"}},
        {"type": "video_url", "video_url": {"url": "http://127.0.0.1:6379/"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "f"}},
        {"type": "text"},
        "text",
    ],
)
def test_a_chat_part_that_is_not_text_is_refused_naming_it(part: Any) -> None:
    body = chat([{"type": "text", "text": "what is this?"}, part])
    with pytest.raises(InvalidRequest) as refused:
        parse_request(CHAT, body)
    assert refused.value.param == "messages"
    assert refused.value.message.startswith("messages[0].content[1] is ")
    assert "only text parts are accepted" in refused.value.message


def test_chat_shape_counts_text_bytes_of_every_message_and_part() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "héllo"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}],
            },
        ],
        "max_completion_tokens": 7,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    shape = parse_request(CHAT, body)
    assert shape.longest_prompt_bytes == len("héllo".encode()) + 3
    assert shape.budget_key == "max_completion_tokens"
    assert shape.max_output_tokens == 7
    assert (shape.n, shape.sequences, shape.stream, shape.include_usage) == (2, 2, True, True)


def test_completions_prompts_as_list_and_token_ids() -> None:
    many = parse_request(COMPLETIONS, {"model": "m", "prompt": ["a", "bbbb"], "best_of": 3})
    assert (many.prompts, many.n, many.sequences, many.longest_prompt_bytes) == (2, 3, 6, 4)
    ids = parse_request(COMPLETIONS, {"model": "m", "prompt": [[1, 2, 3], [4]]})
    assert (ids.token_id_prompt_tokens, ids.prompts) == (3, 2)
    assert prompt_lower_bound(ids, 128) == 3


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"messages": [{"role": "user", "content": "x"}]},
        {"model": "m", "messages": []},
        {"model": "m", "messages": ["x"]},
        chat(max_tokens=0),
        chat(max_tokens=True),
        chat(n="2"),
    ],
)
def test_malformed_chat_bodies_are_invalid_requests(body: Any) -> None:
    with pytest.raises(InvalidRequest):
        parse_request(CHAT, body)


def test_malformed_prompt_is_an_invalid_request() -> None:
    with pytest.raises(InvalidRequest):
        parse_request(COMPLETIONS, {"model": "m", "prompt": [1, "a"]})


def test_cheap_bound_refuses_only_what_cannot_fit_at_the_lower_bound() -> None:
    # 1,000 bytes at <= 10 bytes a token: at least 100 tokens.
    shape = parse_request(CHAT, chat("x" * 1000, max_tokens=50))
    check_bound(shape, 150, 10)
    with pytest.raises(ContextLengthExceeded) as caught:
        check_bound(shape, 149, 10)
    assert (caught.value.stage, caught.value.limit, caught.value.reason) == (
        "bound",
        149,
        "context_length_bound",
    )
    # Without a budget only the prompt's bound counts (the output is then what fits).
    check_bound(parse_request(CHAT, chat("x" * 1000)), 101, 10)


def test_the_bound_key_names_what_is_rendered_around_the_text() -> None:
    chat = InteractiveEndpoint.CHAT_COMPLETIONS
    plain = {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    }
    assert bound_key(chat, plain) == ("chat", "True", "system", "user")
    assert bound_key(chat, {**plain, "add_generation_prompt": False}) == (
        "chat",
        "False",
        "system",
        "user",
    )
    # Anything the template could render beyond roles and plain text: counted exactly.
    assert bound_key(chat, {**plain, "tools": [{"type": "function"}]}) is None
    assert bound_key(chat, {**plain, "chat_template": "{{ messages }}"}) is None
    assert bound_key(chat, {**plain, "continue_final_message": True}) is None
    named = {"model": "m", "messages": [{"role": "user", "content": "Hi", "name": "ann"}]}
    assert bound_key(chat, named) is None
    parts = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    assert bound_key(chat, parts) is None
    completions = InteractiveEndpoint.COMPLETIONS
    assert bound_key(completions, {"model": "m", "prompt": "x"}) == ("prompt",)
    assert bound_key(completions, {"model": "m", "prompt": "x", "suffix": "y"}) is None
    # Token ids need no bound: their count is exact.
    assert parse_request(completions, {"model": "m", "prompt": [1, 2]}).bound_key is None


def test_the_prompt_bound_is_bytes_plus_overhead_plus_a_margin_per_piece_of_text() -> None:
    chat = parse_request(
        InteractiveEndpoint.CHAT_COMPLETIONS,
        {
            "model": "m",
            "messages": [{"role": "system", "content": "héllo"}, {"role": "user", "content": "ab"}],
            "max_tokens": 5,
        },
    )
    assert chat.segments == 2
    assert prompt_upper_bound(chat, 11) == 6 + 2 + 11 + 2 * BOUND_MARGIN_PER_SEGMENT
    prompts = parse_request(
        InteractiveEndpoint.COMPLETIONS, {"model": "m", "prompt": ["abc", "abcdef"]}
    )
    assert prompt_upper_bound(prompts, 1) == 6 + 1 + BOUND_MARGIN_PER_SEGMENT


def test_exact_check_and_the_worst_case_of_an_absent_budget() -> None:
    with_budget = parse_request(CHAT, chat(max_tokens=100))
    assert size_request(with_budget, 412, 512).max_output_tokens == 100
    with pytest.raises(ContextLengthExceeded) as caught:
        size_request(with_budget, 413, 512)
    assert caught.value.stage == "exact"
    assert caught.value.param == "max_tokens"

    open_chat = size_request(parse_request(CHAT, chat()), 12, 512)
    assert (open_chat.max_output_tokens, open_chat.output_defaulted) == (500, True)
    with pytest.raises(ContextLengthExceeded) as prompt_too_long:
        size_request(parse_request(CHAT, chat()), 512, 512)
    assert prompt_too_long.value.param == "messages"

    open_completion = size_request(
        parse_request(COMPLETIONS, {"model": "m", "prompt": "x"}), 3, 512
    )
    assert open_completion.max_output_tokens == 16


def test_sequences_over_the_cap_are_refused_naming_n_or_the_prompts() -> None:
    check_sequences(parse_request(CHAT, chat(n=4)), 4)
    with pytest.raises(OverRequestCap) as many_n:
        check_sequences(parse_request(CHAT, chat(n=5)), 4)
    assert (many_n.value.param, many_n.value.limit) == ("n", 4)
    prompts = {"model": "m", "prompt": ["a"] * 5}
    with pytest.raises(OverRequestCap) as many_prompts:
        check_sequences(parse_request(COMPLETIONS, prompts), 4)
    assert many_prompts.value.param == "prompt"


def test_tokens_over_the_request_cap_are_refused_on_the_bound_and_exactly() -> None:
    shape = parse_request(CHAT, chat("x" * 1000, max_tokens=100, n=4))
    # At least 100 prompt tokens (10 bytes a token) + 100 output, 4 times: 800.
    check_bound(shape, 4096, 10, 800)
    with pytest.raises(OverRequestCap) as on_bound:
        check_bound(shape, 4096, 10, 799)
    assert on_bound.value.param == "max_tokens"
    assert size_request(shape, 150, 4096, 1000).max_output_tokens == 100
    with pytest.raises(OverRequestCap) as exact:
        size_request(shape, 151, 4096, 1000)
    assert (exact.value.param, exact.value.limit) == ("max_tokens", 1000)
    assert "1004 KV tokens" in exact.value.message
    # The prompts alone are over it: lowering max_tokens would not do.
    with pytest.raises(OverRequestCap) as prompts:
        size_request(shape, 250, 4096, 1000)
    assert prompts.value.param == "n"


def test_an_absent_budget_gets_what_the_request_cap_leaves_each_sequence() -> None:
    open_chat = parse_request(CHAT, chat(n=2))
    sizing = size_request(open_chat, 100, 4096, 1000)
    assert (sizing.max_output_tokens, sizing.output_defaulted) == (400, True)
    assert size_request(open_chat, 100, 300, 1000).max_output_tokens == 200  # the context
    with pytest.raises(OverRequestCap) as no_room:
        size_request(open_chat, 500, 4096, 1000)
    assert no_room.value.param == "n"


def test_upstream_body_sets_priority_budget_and_usage_without_touching_the_caller() -> None:
    body = chat(stream=True, priority=-100, stream_options={"continuous_usage_stats": False})
    shape = parse_request(CHAT, body)
    sizing = size_request(shape, 10, 512)
    out = upstream_body(body, shape, sizing, 0)
    assert out["priority"] == 0
    assert out["max_tokens"] == 502
    assert out["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    assert body["priority"] == -100
    assert body["stream_options"] == {"continuous_usage_stats": False}
    given = parse_request(CHAT, chat(max_tokens=5))
    assert "stream_options" not in upstream_body(
        chat(max_tokens=5), given, size_request(given, 1, 512), 0
    )


def _load(node: str, room: int, preemptible: int = 0, pressure: float = 0.0) -> NodeLoad:
    return NodeLoad(node, True, 10_000, room, preemptible, pressure)


def test_ranking_prefers_fit_then_least_preemption_then_room() -> None:
    loads = [
        _load("busy", 2000, pressure=0.8),
        _load("idle", 2000, pressure=0.1),
        _load("preempt-much", 100, preemptible=5000),
        _load("preempt-little", 900, preemptible=5000),
        _load("full", 500),
        NodeLoad("rebuilding", False, 10_000, 9000, 0, 0.0),
    ]
    assert rank_nodes(loads, 1000) == [
        "idle",
        "busy",
        "preempt-little",
        "preempt-much",
        "rebuilding",
        "full",
    ]


def test_wait_budget_obeys_the_caller_and_half_the_client_timeout() -> None:
    assert wait_budget_s(None, 10.0, None) == 10.0
    assert wait_budget_s(0.0, 10.0, None) == 0.0
    assert wait_budget_s(30.0, 10.0, None) == 30.0
    assert wait_budget_s(30.0, 10.0, 8.0) == 4.0
    assert wait_budget_s(None, 10.0, 600.0) == 10.0


def test_wait_budget_is_clamped_to_the_cap() -> None:
    assert wait_budget_s(3600.0, 10.0, None, 60.0) == 60.0
    assert wait_budget_s(30.0, 10.0, None, 60.0) == 30.0
    assert wait_budget_s(3600.0, 10.0, 8.0, 60.0) == 4.0


def _lease(lease_id: str, cls: ServiceClass, tokens: int) -> Lease:
    return Lease(lease_id, "n", cls, tokens, 1, 0, 0)


def test_observed_non_batch_is_engine_use_minus_batch_sequences_in_whole_blocks() -> None:
    assert allocated_tokens(0.5, 6144, 128) == 3072
    assert allocated_tokens(1.2, 6144, 128) == 6144
    leases = [
        _lease("mine", ServiceClass.BATCH, 512),
        _lease("theirs", ServiceClass.BATCH, 256),
        _lease("gateway", ServiceClass.INTERACTIVE, 1024),
    ]
    # Mine holds 130 tokens -> 2 blocks; theirs is unknown -> its whole reservation.
    assert batch_physical_tokens(leases, {"mine": 130}, 128) == 256 + 256
    assert observed_non_batch(0.5, 6144, 128, leases, {"mine": 130}) == 3072 - 512
    assert observed_non_batch(0.0, 6144, 128, leases, {"mine": 130}) == 0
