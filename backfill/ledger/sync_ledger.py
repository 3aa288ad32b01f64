"""The ledger over a synchronous redis-py client, of one server or of a Redis Cluster: the
operations of :mod:`backfill.ledger.operations`, each step run as it comes (maintenance, the
API, tools)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from redis.exceptions import NoScriptError

from backfill import keys as lk
from backfill.errors import LedgerError, LedgerUnavailable
from backfill.ledger import operations
from backfill.ledger.binding import blocking
from backfill.ledger.calls import LedgerCalls
from backfill.ledger.listeners import PreemptionListener
from backfill.ledger.rebuild import rebuild as rebuild_plan
from backfill.ledger.scripts import SCRIPTS, script_source
from backfill.ledger.steps import REDIS_ERRORS, Command, Plan, Scan, ScriptCall, Step, translate
from backfill.policy import PoolPolicy
from backfill.redis_client import SyncRedis, connect

T = TypeVar("T")


class Ledger:
    """The ledger over a synchronous redis-py client."""

    def __init__(
        self,
        client: SyncRedis,
        namespace: str,
        policy: PoolPolicy | None = None,
        lease_ttl_ms: int = 30_000,
    ) -> None:
        self._client = client
        self._calls = LedgerCalls(namespace, policy or PoolPolicy(), lease_ttl_ms)
        self._scripts = {name: client.register_script(script_source(name)) for name in SCRIPTS}

    @classmethod
    def from_url(
        cls, url: str, namespace: str, policy: PoolPolicy | None = None, lease_ttl_ms: int = 30_000
    ) -> Ledger:
        """A ledger on ``url``: one Redis server or a cluster (``redis+cluster://``)."""
        return cls(connect(url), namespace, policy, lease_ttl_ms)

    @property
    def calls(self) -> LedgerCalls:
        return self._calls

    @property
    def keys(self) -> lk.LedgerKeys:
        return self._calls.keys

    @property
    def policy(self) -> PoolPolicy:
        return self._calls.policy

    @property
    def client(self) -> SyncRedis:
        """The Redis client, for the small non-ledger keys read beside it (work budget)."""
        return self._client

    def close(self) -> None:
        self._client.close()

    # -- the operations (documented in backfill.ledger.operations)

    register_pool = blocking(operations.register_pool)
    observe = blocking(operations.observe)
    snapshot = blocking(operations.snapshot)
    counters = blocking(operations.counters)
    nodes = blocking(operations.nodes)
    is_ready = blocking(operations.is_ready)
    incomplete_nodes = blocking(operations.incomplete_nodes)
    mark_incomplete = blocking(operations.mark_incomplete)
    reserve = blocking(operations.reserve)
    reserve_many = blocking(operations.reserve_many)
    settle = blocking(operations.settle)
    settle_many = blocking(operations.settle_many)
    heartbeat = blocking(operations.heartbeat)
    heartbeat_many = blocking(operations.heartbeat_many)
    restore_lease = blocking(operations.restore_lease)
    release = blocking(operations.release)
    release_many = blocking(operations.release_many)
    preempt = blocking(operations.preempt)
    reap = blocking(operations.reap)
    rebuild = blocking(rebuild_plan)

    def listen_preemptions(self, node: str) -> PreemptionListener:
        """A subscription to ``node``'s preempt channel, already subscribed when returned."""
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
        try:
            pubsub.subscribe(self.keys.preempt_channel(node))
        except REDIS_ERRORS as exc:
            raise translate(exc) from exc
        return PreemptionListener(pubsub)

    # -- carrying plans out

    def drive(self, plan: Plan[T]) -> T:
        """Run ``plan``'s steps in turn; returns what it returns. A step's ledger error is
        raised inside the plan, which may undo what it did before (else it goes on up)."""
        try:
            step = next(plan)
            while True:
                try:
                    reply = self._carry_out(step)
                except (LedgerError, LedgerUnavailable) as exc:
                    step = plan.throw(exc)
                else:
                    step = plan.send(reply)
        except StopIteration as done:
            result: T = done.value
            return result

    def _carry_out(self, step: Step) -> Any:
        try:
            if isinstance(step, ScriptCall):
                reply = self._scripts[step.script](keys=step.keys, args=step.args)
            elif isinstance(step, Command):
                reply = self._client.execute_command(*step.args)  # type: ignore[no-untyped-call]
            elif isinstance(step, Scan):
                reply = list(self._client.scan_iter(match=step.pattern, count=1000))
            else:
                reply = self._pipeline_retrying(step.calls)
        except REDIS_ERRORS as exc:
            raise translate(exc) from exc
        return step.parse(reply)

    def _pipeline_retrying(self, calls: Sequence[ScriptCall[Any]]) -> list[Any]:
        if not calls:
            return []
        replies = self._pipeline(calls)
        missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if missing:
            # NOSCRIPT refuses a call before it runs, so running those again is safe.
            for name in {calls[i].script for i in missing}:
                self._client.script_load(script_source(name))
            again = self._pipeline([calls[i] for i in missing])
            for i, r in zip(missing, again, strict=True):
                replies[i] = r
        return replies

    def _pipeline(self, calls: Sequence[ScriptCall[Any]]) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for c in calls:
            # As a raw command: redis-py's cluster pipeline refuses its evalsha() method but
            # routes EVALSHA by its keys (each call's keys share one slot).
            pipe.execute_command(
                "EVALSHA", self._scripts[c.script].sha, len(c.keys), *c.keys, *c.args
            )
        return list(pipe.execute(raise_on_error=False))
