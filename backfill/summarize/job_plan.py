"""The shape of a summarisation job: what one prompt holds, what the whole job will cost, and
how its steps are cut into batch files.

A job is planned from a handful of numbers the engine gives (its context length and what the
map and reduce instructions take around their text): :class:`JobShape` turns them into the
chunk budget of a map step and the fan-in of a reduce step. Its forecast counts every step the
job can make, the reduce steps included (each charged the most its summaries can take), so
the deadline is judged on the whole job at its create, as a batch's is. Its steps go into as
many batch files as the Batch API's limits ask (:class:`BatchCut`), all under the job's one
deadline, and a round cuts them only when the job's queue runs low (:func:`cut_now`). Pure:
no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from backfill.summarize.chunks import ChunkBudget
from backfill.summarize.prompts import SEPARATOR_TOKENS
from backfill.summarize.reduce_plan import fan_in, plan_reduce


@dataclass(frozen=True, slots=True)
class JobShape:
    context_tokens: int
    """The model's context length."""
    map_prompt_tokens: int
    """What the map instruction and the chat template add around a chunk."""
    reduce_prompt_tokens: int
    """What the reduce instruction and the chat template add around the summaries."""
    summary_tokens: int
    """The most one summary may take (each step's ``max_tokens``)."""
    margin_tokens: int = 8

    @property
    def chunk_budget(self) -> ChunkBudget:
        return ChunkBudget(
            self.context_tokens, self.map_prompt_tokens, self.summary_tokens, self.margin_tokens
        )

    @property
    def reduce_budget(self) -> ChunkBudget:
        return ChunkBudget(
            self.context_tokens, self.reduce_prompt_tokens, self.summary_tokens, self.margin_tokens
        )

    @property
    def fan_in(self) -> int:
        """Summaries one reduce step reads (raises ``ReduceInfeasible`` under two)."""
        return fan_in(self.reduce_budget.text_tokens, self.summary_tokens, SEPARATOR_TOKENS)

    def check(self) -> None:
        """Refuse a shape where a chunk holds no text or a reduce no two summaries."""
        self.chunk_budget.check()
        _ = self.fan_in

    def map_tokens(self, chunk_tokens: int) -> int:
        """The most a map step over a chunk of ``chunk_tokens`` holds in the engine."""
        return self.map_prompt_tokens + chunk_tokens + self.summary_tokens

    def reduce_tokens(self, children: int) -> int:
        """The most a reduce step over ``children`` summaries holds in the engine."""
        text = children * (self.summary_tokens + SEPARATOR_TOKENS)
        return self.reduce_prompt_tokens + text + self.summary_tokens

    def document_tokens(self, chunk_tokens: Sequence[int]) -> int:
        """Forecast tokens of one document: its map steps and every reduce step above them."""
        plan = plan_reduce(len(chunk_tokens), self.fan_in)
        return sum(self.map_tokens(t) for t in chunk_tokens) + sum(
            self.reduce_tokens(len(step.children)) for step in plan.steps
        )

    def document_steps(self, chunks: int) -> int:
        """Model calls one document of ``chunks`` chunks makes."""
        return plan_reduce(chunks, self.fan_in).nodes


def job_tokens(shape: JobShape, documents: Iterable[Sequence[int]]) -> int:
    """Forecast tokens of a job over documents given by their chunks' token counts."""
    return sum(shape.document_tokens(chunks) for chunks in documents)


@dataclass(slots=True)
class BatchCut:
    """Where a stream of batch lines is cut into files: a file ends before the line that
    would take it past ``max_lines`` lines or ``max_bytes`` bytes."""

    max_lines: int
    max_bytes: int
    lines: int = 0
    bytes: int = 0

    def __post_init__(self) -> None:
        if self.max_lines < 1 or self.max_bytes < 1:
            raise ValueError("a batch file holds at least one line and one byte")

    def starts_new_file(self, line_bytes: int) -> bool:
        """Whether the line of ``line_bytes`` goes into a new file; counts it either way.
        A line longer than a whole file is the caller's to refuse (it never fits)."""
        if line_bytes > self.max_bytes:
            raise ValueError(f"a line of {line_bytes} bytes is over a file's {self.max_bytes}")
        new = self.lines > 0 and (
            self.lines + 1 > self.max_lines or self.bytes + line_bytes > self.max_bytes
        )
        if new:
            self.lines = self.bytes = 0
        self.lines += 1
        self.bytes += line_bytes
        return new


def cut_now(unbatched: int, waiting: int, full: int) -> bool:
    """Whether a round cuts the job's ``unbatched`` steps into a batch now, with ``waiting``
    of its steps in batches no engine has started yet and ``full`` lines to a batch file.

    A reduce step is made when its children end, which during the map wave is one or two at a
    time; cut as they come, they made dozens of one-line batches, each an upload, a job, an
    ingest and a results file, while the steps would only have queued behind the job's map
    items (the same deadline, stored earlier). So they are held until they fill a file, or
    until the job's queue runs low: no more steps waiting than there are to cut. A job with
    nothing waiting cuts at once (its start, its last reduce levels), so no engine waits on a
    held step; in between, a cut is due while as many steps as it carries still wait ahead of
    it (rounds run as the job's items end), so its batch is made before the queue runs dry.
    """
    return unbatched > 0 and (unbatched >= full or waiting <= unbatched)


BUSY_WAITING_STEPS = 256
"""A job with at least this many steps in batches no engine has started yet is busy."""
BUSY_GAP_FACTOR = 4


def round_gap(base_s: float, waiting_steps: int | None) -> float:
    """How long a node's wakes wait before a job's next round, after one that found
    ``waiting_steps`` of its steps in batches no engine has started.

    A round harvests the items that ended and makes the reduce steps they allow; each reads
    every ended item of the job's open batches, so in a long map wave a round every
    ``base_s`` was most of the worker's own CPU beside the engine (profiled: 2,000 documents,
    ~400 rounds). While many steps wait unstarted, what a sooner round would make queues
    behind them anyway (the same deadline, stored later), and its progress shows a moment
    later: the busy job's rounds come ``BUSY_GAP_FACTOR`` times further apart. Its last levels,
    with few steps waiting, keep the short gap."""
    if waiting_steps is not None and waiting_steps >= BUSY_WAITING_STEPS:
        return base_s * BUSY_GAP_FACTOR
    return base_s
