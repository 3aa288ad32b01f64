"""A summarisation job's shape, forecast and batch files; the driver's decisions for a
document; the steps' request lines."""

from __future__ import annotations

import itertools
import json
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backfill.store.summaries import SummaryJobRecord
from backfill.summarize.chunks import ChunkTooSmall
from backfill.summarize.decide import StepView, decide_document
from backfill.summarize.job_plan import (
    BUSY_GAP_FACTOR,
    BUSY_WAITING_STEPS,
    BatchCut,
    JobShape,
    cut_now,
    job_tokens,
    round_gap,
)
from backfill.summarize.jobs import prepare_document
from backfill.summarize.outcomes import step_outcome
from backfill.summarize.prompts import (
    LINE_OVERHEAD,
    SEPARATOR_TOKENS,
    batch_line,
    custom_id,
    map_messages,
    parse_custom_id,
    reduce_messages,
    request_body,
    sampling_problem,
)
from backfill.summarize.reduce_plan import ReduceInfeasible, plan_reduce
from backfill.summarize.states import DocumentState, StepState, SummaryJobState, sources_of

SHAPE = JobShape(
    context_tokens=2048, map_prompt_tokens=30, reduce_prompt_tokens=60, summary_tokens=128
)


def test_the_shape_gives_the_chunk_budget_and_the_fan_in():
    assert SHAPE.chunk_budget.text_tokens == 2048 - 30 - 128 - 8
    assert SHAPE.fan_in == (2048 - 60 - 128 - 8) // (128 + SEPARATOR_TOKENS)


def test_a_shape_that_cannot_reduce_is_refused():
    with pytest.raises(ReduceInfeasible):
        JobShape(1024, 30, 60, 400).check()
    with pytest.raises(ChunkTooSmall):
        JobShape(256, 30, 60, 300).check()


def test_the_forecast_counts_the_reduce_steps():
    one = SHAPE.document_tokens([500])
    assert one == 30 + 500 + 128  # one chunk: no reduce
    chunks = [1800] * 40
    plan = plan_reduce(40, SHAPE.fan_in)
    assert plan.depth == 2
    maps = 40 * (30 + 1800 + 128)
    reduces = sum(60 + len(s.children) * (128 + SEPARATOR_TOKENS) + 128 for s in plan.steps)
    assert SHAPE.document_tokens(chunks) == maps + reduces
    assert job_tokens(SHAPE, [[500], chunks]) == one + maps + reduces
    assert SHAPE.document_steps(40) == 40 + len(plan.steps)


@given(sizes=st.lists(st.integers(min_value=1, max_value=50), max_size=300))
def test_batch_files_stay_within_both_limits_and_keep_every_line(sizes):
    cut = BatchCut(max_lines=7, max_bytes=120)
    files: list[list[int]] = []
    for size in sizes:
        if cut.starts_new_file(size) or not files:
            files.append([])
        files[-1].append(size)
    assert [s for f in files for s in f] == sizes
    assert all(len(f) <= 7 and sum(f) <= 120 for f in files)
    # A file is cut only where the next line would not fit.
    for first, second in itertools.pairwise(files):
        assert len(first) == 7 or sum(first) + second[0] > 120


@pytest.mark.parametrize(
    ("unbatched", "waiting", "full", "cut"),
    [
        (0, 0, 100, False),  # nothing to cut
        (2, 1_900, 100, False),  # reduce steps of the map wave: they would only queue
        (100, 1_900, 100, True),  # a full file is cut whatever waits
        (150, 150, 100_000, True),  # the queue has run as low as what there is to cut
        (1, 0, 100_000, True),  # nothing waits: cut at once (the start, the last levels)
        (3, 4, 100_000, False),
    ],
)
def test_steps_are_cut_when_they_fill_a_file_or_the_queue_runs_low(
    unbatched: int, waiting: int, full: int, cut: bool
) -> None:
    assert cut_now(unbatched, waiting, full) is cut


def test_a_line_longer_than_a_file_is_refused():
    with pytest.raises(ValueError, match="over a file's"):
        BatchCut(max_lines=10, max_bytes=100).starts_new_file(101)


# --- the driver's decisions ----------------------------------------------------------------

DONE = StepState.SUCCEEDED


def done(summary: str, tokens: int = 10) -> StepView:
    return StepView(DONE, summary, prompt_tokens=tokens, completion_tokens=2)


def test_a_document_of_one_chunk_ends_with_its_map_summary():
    decision = decide_document(1, 4, {0: done("S")})
    assert decision.ended is DocumentState.SUCCEEDED
    assert decision.summary == "S"
    assert decision.split_depth == 0
    assert decide_document(1, 4, {0: StepView(StepState.PENDING)}).ended is None


def test_reduce_steps_are_created_as_their_children_finish_and_once():
    steps = {0: done("a"), 1: done("b"), 2: StepView(StepState.PENDING), 3: done("d"), 4: done("e")}
    # 5 chunks at fan-in 2: (0,1) (2,3) (4) -> ...
    decision = decide_document(5, 2, steps)
    assert [(n.step.children, n.summaries) for n in decision.create] == [((0, 1), ("a", "b"))]
    steps[decision.create[0].step.node] = StepView(StepState.PENDING)
    assert decide_document(5, 2, steps).create == ()  # created already: not again
    steps[2] = done("c")
    assert [n.step.children for n in decide_document(5, 2, steps).create] == [(2, 3)]


def test_the_root_summary_ends_the_document_with_all_usage():
    plan = plan_reduce(3, 4)
    steps = {0: done("a"), 1: done("b"), 2: done("c"), plan.root: done("whole", tokens=40)}
    decision = decide_document(3, 4, steps)
    assert decision.ended is DocumentState.SUCCEEDED
    assert decision.summary == "whole"
    assert decision.prompt_tokens == 70
    assert decision.completion_tokens == 8
    assert decision.split_depth == 1


def test_a_failed_step_fails_the_document_and_creates_nothing():
    steps = {0: done("a"), 1: StepView(StepState.FAILED, error="expired"), 2: done("c")}
    decision = decide_document(3, 2, steps)
    assert decision.ended is DocumentState.FAILED
    assert decision.error == "map step 1 failed: expired"
    assert decision.create == ()


# --- request lines -------------------------------------------------------------------------


def test_a_step_line_is_a_chat_batch_line_its_id_naming_document_and_node():
    body = request_body("m", map_messages("Summarise.", "Text."), 64)
    line = json.loads(batch_line(12, 3, body))
    assert len(batch_line(12, 3, body)) <= len(body) + LINE_OVERHEAD
    assert line["custom_id"] == "12:3"
    assert line["url"] == "/v1/chat/completions"
    assert line["body"] == {
        "model": "m",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Summarise.\n\nText."}],
    }
    assert parse_custom_id(custom_id(12, 3)) == (12, 3)
    assert parse_custom_id("user-id") is None
    assert parse_custom_id("1:x") is None
    content = reduce_messages("Be brief.", [" one ", "two"])[0]["content"]
    assert content.endswith("Be brief.\n\none\n\n---\n\ntwo")


def test_a_jobs_sampling_settings_go_into_every_step_body_before_its_messages():
    sampling = {"temperature": 0, "repetition_penalty": 1.1}
    body = json.loads(request_body("m", map_messages("Summarise.", "Text."), 64, sampling))
    assert body["temperature"] == 0
    assert body["repetition_penalty"] == 1.1
    assert list(body)[-1] == "messages"
    assert body["max_tokens"] == 64


@pytest.mark.parametrize(
    ("sampling", "problem"),
    [
        ({"seed": 1}, "'seed' is not known"),
        ({"max_tokens": 5}, "'max_tokens' is not known"),
        ({"temperature": "hot"}, "'temperature' must be a number"),
        ({"temperature": True}, "'temperature' must be a number"),
        ({"temperature": 3}, "'temperature' must be between 0 and 2"),
        ({"top_k": 2.5}, "'top_k' must be an integer"),
    ],
)
def test_sampling_settings_not_known_or_out_of_range_are_named(
    sampling: dict[str, object], problem: str
) -> None:
    found = sampling_problem(sampling)
    assert found is not None
    assert problem in found


def test_known_sampling_settings_in_range_pass():
    assert sampling_problem({}) is None
    assert sampling_problem({"temperature": 0, "top_p": 0.9, "top_k": 40}) is None


def test_a_job_is_cancelled_from_receiving_or_through_cancelling():
    assert sources_of(SummaryJobState.CANCELLED) == {
        SummaryJobState.RECEIVING,
        SummaryJobState.CANCELLING,
    }
    assert sources_of(SummaryJobState.IN_PROGRESS) == {SummaryJobState.RECEIVING}


def test_a_finished_item_becomes_its_steps_outcome():
    body = {
        "choices": [{"message": {"role": "assistant", "content": " The gist. "}}],
        "usage": {"prompt_tokens": 900, "completion_tokens": 40},
    }
    assert step_outcome("succeeded", json.dumps(body), None) == StepView(
        StepState.SUCCEEDED, "The gist.", 900, 40
    )
    assert step_outcome("running", None, None) is None
    expired = step_outcome("expired", None, "needed 3m, 1m left")
    assert expired is not None
    assert expired.state is StepState.FAILED
    assert expired.error == "expired: needed 3m, 1m left"
    failed = step_outcome("failed", None, json.dumps({"error": {"message": "too long"}}))
    assert failed is not None
    assert failed.error == "failed: too long"
    empty = {"choices": [{"message": {"content": ""}}], "usage": {"prompt_tokens": 5}}
    assert step_outcome("succeeded", json.dumps(empty), None).state is StepState.FAILED
    assert step_outcome("succeeded", "not json", None).state is StepState.FAILED


def test_nul_characters_a_model_emits_are_left_out_of_the_stored_summary_and_error():
    # Postgres text refuses NUL: kept, the outcome could not be stored and the job stalled.
    body = {"choices": [{"message": {"content": "a\x00b\x00"}}], "usage": {}}
    outcome = step_outcome("succeeded", json.dumps(body), None)
    assert outcome is not None
    assert outcome.summary == "ab"
    only_nul = {"choices": [{"message": {"content": "\x00 \x00"}}], "usage": {}}
    assert step_outcome("succeeded", json.dumps(only_nul), None).state is StepState.FAILED
    failed = step_outcome("failed", None, json.dumps({"error": {"message": "bad\x00 line"}}))
    assert failed is not None
    assert failed.error == "failed: bad line"


def _job_record(shape: JobShape) -> SummaryJobRecord:
    now = datetime.now(UTC)
    return SummaryJobRecord(
        id="sumjob_x",
        tenant_id="t",
        model="m",
        instruction="Summarise.",
        completion_window="1h",
        state=SummaryJobState.RECEIVING,
        shape=shape,
        fan_in=shape.fan_in,
        sampling={},
        forecast_tokens=0,
        planned_steps=0,
        deadline=None,
        error=None,
        created_at=now,
        started_at=None,
        ended_at=None,
    )


def test_a_document_whose_bytes_fit_is_one_map_step_without_counting():
    calls: list[str] = []

    def counting(text: str) -> int:
        calls.append(text)
        return len(text.split()) + 1

    job = _job_record(SHAPE)
    doc = prepare_document(job, "a", "A short document.", counting)
    assert calls == []
    assert len(doc.bodies) == 1
    assert json.loads(doc.bodies[0])["messages"][0]["content"] == "Summarise.\n\nA short document."
    assert doc.planned_steps == 1
    assert doc.split_depth == 0


def test_a_long_document_is_split_and_its_forecast_counts_its_reduce():
    def counting(text: str) -> int:
        return len(text.split()) + 1

    job = _job_record(SHAPE)
    text = "\n\n".join("word " * 300 for _ in range(20))  # 6,000 words; a chunk holds 1,882 tokens
    doc = prepare_document(job, "long", text, counting)
    chunks = [
        json.loads(b)["messages"][0]["content"].removeprefix("Summarise.\n\n") for b in doc.bodies
    ]
    assert "".join(chunks) == text
    assert len(chunks) > 1
    plan = plan_reduce(len(chunks), SHAPE.fan_in)
    assert doc.planned_steps == plan.nodes
    assert doc.split_depth == plan.depth == 1
    assert doc.forecast_tokens == SHAPE.document_tokens([counting(c) for c in chunks])


def test_a_long_document_is_counted_whole_once_and_its_chunks_not_again():
    counted: list[str] = []

    def counting(text: str) -> int:
        counted.append(text)
        return len(text.split()) + 1

    job = _job_record(SHAPE)
    text = " ".join(f"Sentence {i} is a short one." for i in range(2000))
    doc = prepare_document(job, "long", text, counting)
    assert len(doc.bodies) > 1
    assert counted.count(text) == 1
    assert len(counted) == len(set(counted)), "a text counted twice"
    assert len(counted) <= 1 + 3 * len(doc.bodies)


def test_blank_or_overlong_id_rows_are_recorded_not_split():
    job = _job_record(SHAPE)
    assert prepare_document(job, "a", "  ", len).error == "empty text"
    assert prepare_document(job, "x" * 600, "text", len).error == "id too long"


def test_a_busy_jobs_rounds_come_further_apart_and_its_tail_keeps_the_short_gap():
    assert round_gap(0.5, None) == 0.5  # nothing read of it: as before
    assert round_gap(0.5, 0) == 0.5
    assert round_gap(0.5, BUSY_WAITING_STEPS - 1) == 0.5
    assert round_gap(0.5, BUSY_WAITING_STEPS) == 0.5 * BUSY_GAP_FACTOR
