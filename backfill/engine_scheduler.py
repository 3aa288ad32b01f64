"""Whether a node's engine runs Backfill's step scheduler, and what it did.

Backfill's scheduler class for vLLM (``backfill_vllm``, installed in the engine's environment)
pauses batch inside the engine's steps while interactive work waits or prefills. It serves its
counters as Prometheus text from the engine-core process (``backfill_sched_*``). A worker that
is told where (``BACKFILL_ENGINE_SCHEDULER_METRICS_URL``) reads them: while they answer, the
engine pauses batch itself, so the worker's work budget stops preempting batch to protect
interactive time to first token (the KV ledger and deadlines stay exactly as they are). The
worker publishes what it read for ``/v1/capacity``.

Parsing and the published record are pure values here; the Redis calls are two small
functions at the end.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from backfill.keys import LedgerKeys
from backfill.redis_client import AsyncRedis, SyncRedis

SCHEDULER_INFO = "backfill_sched_info"


@dataclass(frozen=True, slots=True)
class EngineScheduler:
    """What a node's engine scheduler says of itself and of what it did since it started."""

    version: str
    vllm_version: str
    batch_priority: int
    paused_steps: int = 0
    """Steps in which at least one resident batch sequence carried no tokens."""
    tokens_held: int = 0
    """Tokens paused batch sequences would have carried in those steps."""
    pauses: int = 0
    relief: int = 0
    """Paused batch sequences given tokens at the starvation bound."""
    preemptions: int = 0
    """Batch sequences the engine preempted for interactive work (KV or sequence slots)."""
    paused_now: int = 0
    longest_pause_s: float = 0.0
    worker_batch_priority: int | None = None
    """The priority the node's worker sends batch at (set by the worker when it publishes;
    None as read from the engine)."""

    @property
    def agrees(self) -> bool:
        """Whether the worker sends batch at the priority the engine takes as batch (unknown
        counts as agreeing)."""
        return self.worker_batch_priority in (None, self.batch_priority)

    @property
    def name(self) -> str:
        return f"backfill_vllm {self.version} (vLLM {self.vllm_version})"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> EngineScheduler | None:
        try:
            fields = json.loads(raw)
            return cls(**fields) if isinstance(fields, dict) else None
        except (ValueError, TypeError):
            return None


_COUNTS: Mapping[str, str] = {
    "backfill_sched_batch_paused_steps_total": "paused_steps",
    "backfill_sched_batch_tokens_held_total": "tokens_held",
    "backfill_sched_batch_pauses_total": "pauses",
    "backfill_sched_batch_relief_total": "relief",
    "backfill_sched_batch_preemptions_total": "preemptions",
    "backfill_sched_batch_paused": "paused_now",
}


def parse_scheduler_metrics(text: str) -> EngineScheduler | None:
    """The scheduler's view from its metrics text; None when the text is not the scheduler's
    (no ``backfill_sched_info`` sample) or not Prometheus text at all."""
    counts: dict[str, float] = {}
    info: dict[str, str] | None = None
    longest = 0.0
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == SCHEDULER_INFO and sample.value == 1:
                    info = dict(sample.labels)
                elif sample.name == "backfill_sched_batch_longest_pause_seconds":
                    longest = max(longest, sample.value)
                elif sample.name in _COUNTS:
                    field = _COUNTS[sample.name]
                    counts[field] = counts.get(field, 0.0) + sample.value
    except (ValueError, TypeError, IndexError):
        return None
    if info is None:
        return None
    try:
        priority = int(info.get("batch_priority", "10"))
    except ValueError:
        return None
    return EngineScheduler(
        version=info.get("version", "?"),
        vllm_version=info.get("vllm_version", "?"),
        batch_priority=priority,
        longest_pause_s=longest,
        **{k: int(v) for k, v in counts.items()},
    )


async def publish_scheduler(
    client: AsyncRedis, keys: LedgerKeys, node: str, view: EngineScheduler, ttl_s: float
) -> None:
    """Say for ``ttl_s`` that ``node``'s engine runs the step scheduler (and what it did)."""
    await client.set(keys.engine_scheduler(node), view.to_json(), px=max(1, int(ttl_s * 1000)))


def read_scheduler(client: SyncRedis, keys: LedgerKeys, node: str) -> EngineScheduler | None:
    raw: Any = client.get(keys.engine_scheduler(node))
    return None if raw is None else EngineScheduler.from_json(raw)
