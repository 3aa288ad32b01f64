"""The non-streaming body folded from a stream's events (pure: no engine)."""

from __future__ import annotations

from typing import Any

from worker.response import ResponseAssembler

USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def chat_event(delta: dict[str, Any], **choice: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-x",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, **choice}],
    }


def test_chat_text_tool_calls_logprobs_and_finish_are_folded_as_the_engine_answers() -> None:
    answer = ResponseAssembler(chat=True)
    answer.add(chat_event({"role": "assistant", "content": ""}))
    answer.add(
        chat_event(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"ci'},
                    }
                ]
            },
            logprobs={
                "content": [{"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": []}]
            },
        )
    )
    answer.add(
        chat_event(
            {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]},
            logprobs={
                "content": [{"token": "b", "logprob": -0.2, "bytes": [98], "top_logprobs": []}]
            },
        )
    )
    answer.add(chat_event({}, finish_reason="tool_calls", stop_reason=None))
    answer.add({"id": "chatcmpl-x", "choices": [], "usage": USAGE, "system_fingerprint": "fp"})
    body = answer.body(response_id="r1", model="m", created=7, usage=USAGE)
    assert body["id"] == "chatcmpl-r1"
    assert body["object"] == "chat.completion"
    assert body["system_fingerprint"] == "fp"
    assert body["usage"] == USAGE
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["role"] == "assistant"
    assert message["content"] is None  # only a tool call, as the engine answers
    assert message["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        }
    ]
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["a", "b"]


def test_chat_text_joins_and_a_resume_puts_the_kept_text_first() -> None:
    answer = ResponseAssembler(chat=True)
    answer.add(chat_event({"content": " world"}))
    answer.add(chat_event({"content": "!"}, finish_reason="stop"))
    body = answer.body(response_id="r", model="m", created=1, usage=USAGE, kept={0: "Hello"})
    (choice,) = body["choices"]
    assert choice["message"]["content"] == "Hello world!"
    assert "tool_calls" not in choice["message"]  # none: absent, as vLLM writes it
    assert choice["logprobs"] is None
    assert answer.text(0) == " world!"


def test_completions_logprobs_are_the_four_lists_in_order() -> None:
    answer = ResponseAssembler(chat=False)
    for token, offset in (("a", 0), ("b", 1)):
        answer.add(
            {
                "id": "cmpl-x",
                "object": "text_completion",
                "choices": [
                    {
                        "index": 0,
                        "text": token,
                        "finish_reason": None,
                        "logprobs": {
                            "tokens": [token],
                            "token_logprobs": [-0.5],
                            "top_logprobs": [{token: -0.5}],
                            "text_offset": [offset],
                        },
                    }
                ],
            }
        )
    answer.add(
        {"choices": [{"index": 0, "text": "", "finish_reason": "length", "stop_reason": None}]}
    )
    body = answer.body(response_id="r", model="m", created=1, usage=USAGE)
    (choice,) = body["choices"]
    assert body["object"] == "text_completion"
    assert choice["text"] == "ab"
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"] == {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.5, -0.5],
        "top_logprobs": [{"a": -0.5}, {"b": -0.5}],
        "text_offset": [0, 1],
    }


def test_an_answer_completed_by_an_earlier_attempt_ends_with_length() -> None:
    body = ResponseAssembler(chat=False).body(
        response_id="r",
        model="m",
        created=1,
        usage=USAGE,
        kept={0: "all of it"},
        finish_reason="length",
    )
    (choice,) = body["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("all of it", "length")
