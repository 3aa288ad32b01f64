"""``bench.prefix``'s workload and verdict, pure: a summarisation job whose lines all start with
one long shared instruction (each with a document of its own), what one side's run measured,
and the figures and goals the run closes on (issue 36's Measure).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

CONCURRENCY_GOAL = 2.0
"""Peak batch sequences at once, the prefix shared against whole prompts reserved."""
THROUGHPUT_GOAL = 1.5
"""Batch output tokens/s, the prefix shared against whole prompts reserved."""
STRAIGHT_GOAL = 0.95
"""Batch output tokens/s, the prefix shared against a straight client at the same concurrency."""

RULE = "Rule {n}: keep every name, date and figure the document gives, in its own words."


@dataclass(frozen=True)
class PrefixWorkload:
    model: str
    items: int
    instruction_tokens: int
    doc_tokens: tuple[int, int]
    max_tokens: int
    kv_blocks: int
    """The engine's KV pool (``num_gpu_blocks_override``): small, so batch slack binds."""
    vary_output: bool = False
    """Each item's ``max_tokens`` drawn from half to one and a half of ``max_tokens`` (seeded)
    instead of all alike, so items end at different times (as real summaries do)."""


def workload(quick: bool, model: str | None = None) -> PrefixWorkload:
    """The issue's shape (a ~1,000-token instruction, documents of 200-600 tokens, 200 output
    tokens) on a pool that holds a handful of whole prompts; ``--quick`` on the tiny model."""
    if quick:
        return PrefixWorkload(model or "tiny", 48, 1000, (200, 600), 200, 160)
    return PrefixWorkload(model or "smollm2", 160, 1000, (200, 600), 200, 160)


def instruction(rules: int) -> str:
    """The shared instruction: a heading and ``rules`` numbered rules."""
    if rules < 1:
        raise ValueError(f"an instruction needs at least one rule, not {rules}")
    body = "\n".join(RULE.format(n=n) for n in range(1, rules + 1))
    return f"You summarise documents for an archive. Follow every rule below.\n{body}\n"


def rules_for(target_tokens: int, tokens_of_one: int, tokens_of_ten: int) -> int:
    """How many rules make an instruction of about ``target_tokens``, from the token counts of
    the instruction with one rule and with ten."""
    per_rule = (tokens_of_ten - tokens_of_one) / 9
    if per_rule <= 0:
        raise ValueError(
            f"rules add no tokens ({tokens_of_one} with one, {tokens_of_ten} with ten)"
        )
    return max(1, round(1 + (target_tokens - tokens_of_one) / per_rule))


def doc_lengths(n: int, low: int, high: int, seed: int = 36) -> list[int]:
    """``n`` document lengths in tokens, uniform in ``[low, high]``, seeded."""
    if not 0 < low <= high:
        raise ValueError(f"document lengths need 0 < low <= high, not {low}..{high}")
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(n)]


def output_lengths(n: int, mean: int, vary: bool, seed: int = 37) -> list[int]:
    """Each item's output tokens: ``mean`` for all, or (``vary``) uniform in
    ``[mean // 2, mean + mean // 2]``, seeded."""
    if mean < 2:
        raise ValueError(f"output tokens need a mean of at least 2, not {mean}")
    if not vary:
        return [mean] * n
    rng = random.Random(seed)
    return [rng.randint(mean // 2, mean + mean // 2) for _ in range(n)]


def document(corpus: str, index: int, chars: int) -> str:
    """A document of ``chars`` characters cut from ``corpus`` at a place of its own (wrapping),
    headed by its index so no two documents start alike."""
    if not corpus:
        raise ValueError("the corpus is empty")
    start = (index * 7919) % len(corpus)
    text = corpus[start:]
    while len(text) < chars:
        text += "\n\n" + corpus
    return f"Document {index}.\n{text[:chars]}"


def prompt(shared: str, doc: str) -> str:
    return f"{shared}\nDocument to summarise:\n{doc}\n\nSummary:"


def request_body(model: str, text: str, max_tokens: int) -> dict[str, Any]:
    """A chat body every side sends alike (chat: ``vllm run-batch`` takes no completions):
    greedy, exactly ``max_tokens`` out."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


@dataclass
class SideResult:
    side: str
    items: int
    seconds: float
    output_tokens: int
    concurrency: list[int] = field(default_factory=list)
    """Batch sequences at once, per sample (ledger leases; the client's own count in flight)."""
    over_reserved: int = 0
    """The most KV tokens the engine held above what the ledger reserved, over the samples."""
    samples: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def peak(self) -> int:
        return max(self.concurrency, default=0)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.concurrency) if self.concurrency else 0.0


def over_reserved(held: int, reserved: int) -> int:
    """KV tokens held beyond the reservation (0 when within it)."""
    return max(0, held - reserved)


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


@dataclass(frozen=True)
class Verdict:
    concurrency_ratio: float
    throughput_ratio: float
    straight_ratio: float
    over_reserved: int

    @property
    def checks(self) -> list[tuple[str, float, str, bool]]:
        """(figure, value, goal, held) for each condition of the goal."""
        return [
            (
                "concurrency ratio (peak, shared / whole)",
                self.concurrency_ratio,
                f">= {CONCURRENCY_GOAL}",
                self.concurrency_ratio >= CONCURRENCY_GOAL,
            ),
            (
                "throughput ratio (shared / whole)",
                self.throughput_ratio,
                f">= {THROUGHPUT_GOAL}",
                self.throughput_ratio >= THROUGHPUT_GOAL,
            ),
            (
                "straight-client ratio (shared / client)",
                self.straight_ratio,
                f">= {STRAIGHT_GOAL}",
                self.straight_ratio >= STRAIGHT_GOAL,
            ),
            (
                "allocated over reserved (KV tokens)",
                self.over_reserved,
                "== 0",
                not self.over_reserved,
            ),
        ]

    @property
    def holds(self) -> bool:
        return all(held for *_, held in self.checks)


def verdict(shared: SideResult, whole: SideResult, straight: SideResult) -> Verdict:
    return Verdict(
        concurrency_ratio=ratio(shared.peak, whole.peak),
        throughput_ratio=ratio(shared.tokens_per_s, whole.tokens_per_s),
        straight_ratio=ratio(shared.tokens_per_s, straight.tokens_per_s),
        over_reserved=max(shared.over_reserved, whole.over_reserved),
    )


def side_rows(sides: Sequence[SideResult]) -> list[tuple[Any, ...]]:
    """One table row a side; a side whose concurrency was not sampled (run-batch) shows "-"."""
    return [
        (
            s.side,
            s.items,
            s.seconds,
            s.output_tokens,
            s.tokens_per_s,
            s.peak if s.concurrency else "-",
            s.mean if s.concurrency else "-",
            s.over_reserved if s.samples else "-",
        )
        for s in sides
    ]
