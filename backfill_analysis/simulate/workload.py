"""Batch work for the simulator: items of bulk jobs, each job with a deadline.

Sizes are drawn from a seeded generator so runs repeat exactly. A summarisation-like default:
prompts of a few hundred tokens, ``max_tokens`` declared, and actual outputs that stop well
before it (what makes overcommit worth having).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchItem:
    """One row of a batch job."""

    key: int
    job: int
    prompt_tokens: int
    max_output_tokens: int
    output_tokens: int
    """What the engine will really generate (<= max): unknown to admission."""
    deadline_s: float
    """Seconds after the simulation's start."""
    prefix_tokens: int = 0
    """The leading tokens of ``prompt_tokens`` every item of the job shares (its instruction):
    0, none. Which prefix: the job's."""


@dataclass(frozen=True)
class BatchWorkload:
    """The shape of the batch jobs."""

    items: int = 100_000
    jobs: int = 10
    prompt_mean: int = 600
    prompt_min: int = 64
    prompt_max: int = 2_000
    max_output_tokens: int = 256
    output_ratio_alpha: float = 2.0
    output_ratio_beta: float = 3.0
    """Actual output / max output ~ Beta(alpha, beta): mean 0.4 by default."""
    first_deadline_s: float = 1_800.0
    last_deadline_s: float = 7_200.0
    """Job deadlines spread evenly between these (seconds after the start)."""
    shared_prefix_tokens: int = 0
    """A shared instruction of this many tokens in front of every item's prompt, one per job
    (issue 36): the prompt sizes above are then the documents' after it. 0: none."""
    output_exact: bool = False
    """Every item generates its ``max_output_tokens`` (``ignore_eos``, as ``bench.prefix``'s
    items do) instead of the Beta-drawn share of it."""

    def __post_init__(self) -> None:
        if self.items < 0 or self.jobs <= 0:
            raise ValueError("items must be >= 0 and jobs > 0")
        if not self.prompt_min <= self.prompt_mean <= self.prompt_max:
            raise ValueError("need prompt_min <= prompt_mean <= prompt_max")
        if self.max_output_tokens <= 0:
            raise ValueError("max_output_tokens must be positive")
        if self.shared_prefix_tokens < 0:
            raise ValueError("shared_prefix_tokens must be >= 0")


def batch_items(workload: BatchWorkload, seed: int) -> list[BatchItem]:
    """The items, in earliest-deadline-first order (the order workers claim them)."""
    rng = random.Random(seed)
    deadlines = [
        workload.first_deadline_s
        + (workload.last_deadline_s - workload.first_deadline_s) * j / max(1, workload.jobs - 1)
        for j in range(workload.jobs)
    ]
    items: list[BatchItem] = []
    for key in range(workload.items):
        job = key % workload.jobs
        # Log-normal-ish prompt sizes around the mean, clipped to the declared range.
        prompt = int(rng.lognormvariate(0.0, 0.5) * workload.prompt_mean / 1.133)
        prompt = min(workload.prompt_max, max(workload.prompt_min, prompt))
        ratio = rng.betavariate(workload.output_ratio_alpha, workload.output_ratio_beta)
        output = max(1, min(workload.max_output_tokens, round(ratio * workload.max_output_tokens)))
        if workload.output_exact:
            output = workload.max_output_tokens
        prefix = workload.shared_prefix_tokens
        items.append(
            BatchItem(
                key,
                job,
                prefix + prompt,
                workload.max_output_tokens,
                output,
                deadlines[job],
                prefix,
            )
        )
    items.sort(key=lambda i: (i.deadline_s, i.key))
    return items
