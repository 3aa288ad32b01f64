"""When a simulated GPU node's items make their tokens: the simulator's step-time model, no GPU.

``bench.fleet`` replaces each node's engine with this schedule so that only the control plane
(Postgres, Redis, the maintenance tick) is charged to this machine. The step times come from
the simulator's cost model (``backfill_analysis.simulate``: by default the roofline model of
Llama-3.1-8B on one H100, the ``h100-llama-3.1-8b`` scenario's engine).

The schedule is fluid, not step by step: when a claim's items start, their prompts are
prefilled in chunks of at most ``max_batched_tokens`` (each chunk one step, beside the node's
decoding sequences), and each then decodes one token per decode step of the batch it joined.
A node at ``max_in_flight`` sequences thus makes what the cost model says such a batch makes,
without this machine running ~30 steps a second per node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from backfill_analysis.simulate.costmodel import CostModel, StepWork, prefill_attention
from backfill_analysis.simulate.scenario import h100_llama8b


@dataclass(frozen=True, slots=True)
class Timeline:
    """One item's run, in seconds on the harness' monotonic clock."""

    first_token_at: float
    token_s: float
    """Time between its tokens (one decode step of the batch it joined)."""
    output_tokens: int
    settle_every_tokens: int

    @property
    def done_at(self) -> float:
        return self.first_token_at + max(self.output_tokens - 1, 0) * self.token_s

    def settles(self) -> list[tuple[float, int]]:
        """(when, tokens generated) of each settle the dispatcher sends: whenever the output
        grew by ``settle_every_tokens`` since the last one (``AttemptRunner._run``)."""
        every = self.settle_every_tokens
        if every <= 0:
            return []
        return [
            (self.first_token_at + (generated - 1) * self.token_s, generated)
            for generated in range(every, self.output_tokens + 1, every)
        ]


@dataclass(frozen=True)
class NodeModel:
    """One GPU node's engine as a cost model plus vLLM's step limits."""

    cost: CostModel
    max_batched_tokens: int = 8192

    def decode_step_s(self, sequences: int, mean_context: int) -> float:
        return self.cost.step_seconds(
            StepWork(decode_tokens=sequences, decode_context=sequences * mean_context)
        )

    def start(
        self,
        now: float,
        prompts: Sequence[int],
        outputs: Sequence[int],
        decoding: int,
        settle_every_tokens: int,
    ) -> list[Timeline]:
        """Timelines of items started together at ``now`` on a node already decoding
        ``decoding`` sequences: prompts prefilled in order, chunk by chunk, then every item
        decodes at the step time of the batch they make together."""
        if len(prompts) != len(outputs):
            raise ValueError("one output length per prompt")
        if not prompts:
            return []
        batch = decoding + len(prompts)
        mean_context = int(
            sum(p + o / 2 for p, o in zip(prompts, outputs, strict=True)) / len(prompts)
        )
        token_s = self.decode_step_s(batch, mean_context)
        # Chunked prefill: each step carries up to max_batched_tokens of prompt, in order; a
        # prompt is ready (its first token out) when the step carrying its last chunk ends.
        ready: list[float] = [0.0] * len(prompts)
        pending: list[int] = []
        t = now
        room = self.max_batched_tokens
        chunk_tokens = 0
        chunk_attention = 0.0
        for i, prompt in enumerate(prompts):
            done = 0
            while done < prompt:
                take = min(prompt - done, room)
                chunk_tokens += take
                chunk_attention += prefill_attention(done, take)
                done += take
                room -= take
                if done == prompt:
                    pending.append(i)
                if room == 0:
                    t += self._prefill_step_s(chunk_tokens, chunk_attention, decoding)
                    for j in pending:
                        ready[j] = t
                    pending.clear()
                    room, chunk_tokens, chunk_attention = self.max_batched_tokens, 0, 0.0
            if prompt <= 0:
                pending.append(i)
        if pending:
            if chunk_tokens:
                t += self._prefill_step_s(chunk_tokens, chunk_attention, decoding)
            for j in pending:
                ready[j] = t
        return [
            Timeline(r, token_s, o, settle_every_tokens)
            for r, o in zip(ready, outputs, strict=True)
        ]

    def _prefill_step_s(self, tokens: int, attention: float, decoding: int) -> float:
        return self.cost.step_seconds(
            StepWork(prefill_tokens=tokens, prefill_attention=attention, decode_tokens=decoding)
        )


def h100_node() -> NodeModel:
    """The ``h100-llama-3.1-8b`` scenario's engine: roofline H100, 8,192 batched tokens."""
    engine = h100_llama8b().engine
    return NodeModel(engine.cost, engine.max_num_batched_tokens)
