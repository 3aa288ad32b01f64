"""The node as the dispatcher's plans see it: plain values, gathered by the worker's loop.

The loop holds live attempts (tasks, streams, leases); before it plans it takes a
:class:`NodeView` of them, and the plans (``backfill.dispatch``) decide from that alone. Times
are the worker's monotonic clock in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from backfill.policy import ServiceClass
from backfill.work_budget import WorkBudget


@dataclass(frozen=True, slots=True)
class FlightView:
    """One attempt in flight on the node: an item run under a lease.

    Shaped as :class:`backfill.policy.VictimCandidate`, so the victim choosers take it as a
    lease."""

    item_id: int
    attempt: int
    lease_id: str
    tokens: int
    """The lease's reservation."""
    deadline_ms: int | None
    preemptible: bool
    prompt_tokens: int = 0
    """The original prompt's tokens: with ``generated``, what the sequence holds in the engine."""
    prefill_tokens: int = 0
    """What this run prefills, for every sequence it creates."""
    generated: int = 0
    """Output tokens so far, earlier attempts' included."""
    kept: int = 0
    """Output tokens of earlier attempts this run continues from."""
    started_s: float = 0.0
    first_token_at: float | None = None
    """Until its first token the attempt is in prefill: its prompt counts against the work
    budget's prefill tokens."""
    last_chunk_at: float = 0.0
    """When the engine last sent anything for it."""
    stopping: bool = False
    """The dispatcher is stopping it (it no longer counts against the work budget)."""
    generating: bool = True
    """Its stream still runs (not done and waiting for its result to be written)."""

    @property
    def service_class(self) -> ServiceClass:
        return ServiceClass.BATCH

    @property
    def generated_tokens(self) -> int:
        # Output of this attempt only: a resumed item keeps what earlier attempts produced.
        return self.generated - self.kept

    @property
    def started_at_ms(self) -> int:
        return int(self.started_s * 1000)

    @property
    def awaiting_first_token(self) -> bool:
        return self.first_token_at is None


@dataclass(frozen=True, slots=True)
class BatchLoad:
    """Batch on a node in the counts admission needs (the simulator keeps these itself)."""

    in_flight: int
    """Every attempt held, those being stopped included."""
    active: int
    """Attempts not being stopped: what counts against the work budget."""
    prefilling: int
    """Prompt tokens of the active attempts still awaiting their first token."""


@dataclass(frozen=True, slots=True)
class NodeView:
    """What the plans know of one node's dispatcher at one instant."""

    flights: tuple[FlightView, ...] = ()
    budget: WorkBudget | None = None
    """The batch work budget now; None: the node runs without one."""
    engine_suspect: bool = False
    """An attempt stalled on an engine that answers but makes no progress: one item at a time
    is sent until one gets output again."""
    typical_reservation: int = 0
    """Recent reservations' running mean (0: none yet)."""
    typical_prompt: int = 0
    """The running mean of what recent starts prefill (their prompts less the cached prefixes
    they lean on; 0: none yet): the claim is sized by it against the work budget's prefill
    room."""
    leases_held: int = 0
    """Leases the node's dispatcher holds in the ledger, also those whose attempts have left
    ``flights`` but whose release is still on its way."""

    @property
    def holds_leases(self) -> bool:
        """Whether the node's slack is held by any lease of this dispatcher's: a lease ending
        will free some, so a reservation that does not fit now waits for that rather than
        going to the ledger to be denied (and deferred)."""
        return bool(self.flights) or self.leases_held > 0

    @property
    def active(self) -> tuple[FlightView, ...]:
        """In-flight attempts not being stopped: what counts against the work budget."""
        return tuple(f for f in self.flights if not f.stopping)

    @property
    def running(self) -> tuple[FlightView, ...]:
        """Active attempts still generating: the only ones a preemption can stop."""
        return tuple(f for f in self.active if f.generating)

    @property
    def load(self) -> BatchLoad:
        active = self.active
        return BatchLoad(len(self.flights), len(active), prefilling(active))


def prefilling(flights: tuple[FlightView, ...]) -> int:
    """Prompt tokens of the attempts still awaiting their first token: what counts against the
    work budget's prefill room."""
    return sum(f.prefill_tokens for f in flights if f.first_token_at is None)


def running_mean(typical: int, value: int) -> int:
    """The running figure the claim is sized by: the first value, then 3/4 old + 1/4 new."""
    return value if not typical else (3 * typical + value) // 4
