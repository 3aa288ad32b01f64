"""How one node's dispatcher behaves: its settings, a plain value the plans read.

Built from the process settings by ``worker.node.dispatch_config``; the plans
(``backfill.dispatch``) take the fields they need, the worker's loop the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from backfill.dispatch.prefix_starts import FIRST_PREFILL_WAIT_S, PREFIX_PASS_HOLD_S
from backfill.work_budget import WorkBudgetPolicy


@dataclass(frozen=True)
class DispatchConfig:
    """How one node's dispatcher behaves."""

    node: str
    claim_batch: int = 64
    max_in_flight: int = 128
    """Sequences in flight at most (the engine's own ``--max-num-seqs`` is the other cap)."""
    lease_ttl_s: float = 30.0
    heartbeat_interval_s: float = 5.0
    idle_poll_s: float = 0.5
    """How often an idle claim loop looks for work; a job's create rings it at once
    (``backfill.work_bell``), so this bounds only what a lost ring costs."""
    batch_priority: int = 10
    """vLLM priority of batch requests (lower runs first; interactive uses 0)."""
    stream_interval: int = 1
    """Output tokens per streamed chunk asked of the engine (1: every token)."""
    tenant_cache_salt: bool = True
    """Each item's requests carry its tenant's ``cache_salt`` (``backfill.cache_salt``)."""
    prefix_caching: bool = False
    """The engine shares prompt prefixes (its ``enable_prefix_caching``): the node's ledger
    may hold a shared prefix once for the items that start with it (issue 36)."""
    prefix_pass_hold_s: float = PREFIX_PASS_HOLD_S
    """Where the node looks for prefixes, how long at most its claims leave a new job's items
    that the job's prefix pass has not recorded yet (``backfill.dispatch.prefix_claim_hold_s``)."""
    first_prefill_wait_s: float = FIRST_PREFILL_WAIT_S
    """How long a prefix's group waits for its first holder's prefill on this node."""
    max_preemptions: int = 3
    """At this many preemptions an item reserves as non-preemptible (no thrashing)."""
    max_attempts: int = 5
    """An item whose attempts keep failing (engine errors, crashes) fails after this many."""
    grace_s: float = 30.0
    """On stop, how long in-flight items may finish before they are aborted and requeued."""
    result_flush_s: float = 0.05
    decode_tokens_per_s: float = 20.0
    """Per-sequence decode rate assumed until one is measured (deadline feasibility)."""
    prefill_tokens_per_s: float = 1000.0
    settle_every_tokens: int = 32
    """An item's progress is reported to the ledger once it grew by this many tokens..."""
    settle_interval_s: float = 1.0
    """...at the next of these intervals, for every such item of the node in one round trip
    (``settle_many``). One call per item per 32 tokens was ~9 Redis calls per 300-token item,
    ~90,000 calls/s for a 1,000-node fleet (``bench.fleet``); progress only steers the choice
    of preemption victims, which a second-old figure serves as well."""
    tokenize_concurrency: int = 8
    """Prompt counts asked of the engine at once. vLLM's ``/tokenize`` serves a few
    concurrent requests best: on 2 cores, 8 at once counted ~150-220 prompts/s and 64 at once
    ~40-70/s (both httpx and the server slow down with many connections), and a claim's items
    start only once all of them are counted."""
    observe_interval_s: float = 1.0
    """How often the engine's non-batch KV use is reported to the ledger (``backfill.observe``);
    0 turns it off."""
    work_budget: WorkBudgetPolicy | None = None
    """The batch work budget's controller (``backfill.work_budget``); None: no work budget,
    only ``max_in_flight`` and the KV slack bound batch."""
    budget_interval_s: float = 0.25
    """How often the work budget is stepped from fresh signals."""
    budget_interval_with_scheduler_s: float = 1.0
    """... and while the engine's step scheduler answers (it pauses batch itself; the budget
    only bounds what is in flight)."""
    signal_ttl_s: float = 3.0
    """Gateway signals older than this are ignored (the gateway that wrote them is gone)."""
    scheduler_metrics_url: str | None = None
    """Where the engine's step scheduler (``backfill_vllm``) serves its metrics. While they
    answer, the engine pauses batch itself and the work budget preempts nothing for TTFT."""
    scheduler_poll_s: float = 5.0
    stall_timeout_s: float = 120.0
    """An attempt whose stream sent nothing for this long while its engine made no progress
    at all (no token prefilled or generated for anyone) is stopped as an engine error: a hung
    engine must not hold items and leases until their deadlines. Waiting behind interactive
    work is not a stall: the engine is busy then. 0 turns the watch off."""
