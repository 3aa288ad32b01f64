"""The ledger over a synchronous redis-py client, of one server or of a Redis Cluster: the
operations of :mod:`backfill.ledger.operations` (bound in :mod:`backfill.ledger.binding`),
each step run as it comes (maintenance, the API, tools)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from redis.commands.core import Script
from redis.exceptions import NoScriptError

from backfill.errors import LedgerError, LedgerUnavailable
from backfill.ledger.binding import LedgerBinding
from backfill.ledger.listeners import ChannelListener
from backfill.ledger.steps import (
    REDIS_ERRORS,
    Command,
    Commands,
    Plan,
    Scan,
    ScriptCall,
    Step,
    eval_args,
    translate,
)
from backfill.redis_client import SyncRedis, connect

T = TypeVar("T")


class Ledger(LedgerBinding[SyncRedis, Script]):
    """The ledger over a synchronous redis-py client."""

    @classmethod
    def _connect(cls, url: str) -> SyncRedis:
        return connect(url)

    def _register(self, client: SyncRedis, source: str) -> Script:
        return client.register_script(source)

    def close(self) -> None:
        self._client.close()

    def listen_preemptions(self, node: str) -> ChannelListener:
        """A subscription to ``node``'s preempt channel, already subscribed when returned."""
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call, unused-ignore]
        try:
            pubsub.subscribe(self.keys.preempt_channel(node))
        except REDIS_ERRORS as exc:
            raise translate(exc) from exc
        return ChannelListener(pubsub)

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
                reply = self._script_call(step)
            elif isinstance(step, Command):
                reply = self._client.execute_command(*step.args)  # type: ignore[no-untyped-call, unused-ignore]
            elif isinstance(step, Commands):
                reply = self._pipeline_commands(step.commands)
            elif isinstance(step, Scan):
                reply = list(self._client.scan_iter(match=step.pattern, count=1000))
            else:
                reply = self._pipeline_retrying(step.calls)
        except REDIS_ERRORS as exc:
            raise translate(exc) from exc
        return step.parse(reply)

    def _script_call(self, call: ScriptCall[Any]) -> Any:
        try:
            return self._scripts[call.script](keys=call.keys, args=call.args)
        except NoScriptError:
            # redis-py loaded the script again and still found it missing: after a failover
            # its view of the cluster may load it elsewhere (a promoted replica has no
            # scripts). EVAL goes where the keys are and caches the script there.
            return self._client.execute_command(*eval_args(call))  # type: ignore[no-untyped-call, unused-ignore]

    def _pipeline_retrying(self, calls: Sequence[ScriptCall[Any]]) -> list[Any]:
        if not calls:
            return []
        replies = self._pipeline(calls)
        missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if missing:
            # NOSCRIPT refuses a call before it runs, so running those again is safe; as EVAL,
            # which goes where the keys are and caches the script there (SCRIPT LOAD after a
            # failover may go by a stale view of the cluster, and a promoted replica has no
            # scripts of its own).
            again = self._pipeline([calls[i] for i in missing], by_source=True)
            for i, r in zip(missing, again, strict=True):
                replies[i] = r
        return replies

    def _pipeline_commands(self, commands: Sequence[Command[Any]]) -> list[Any]:
        if not commands:
            return []
        pipe = self._client.pipeline(transaction=False)
        for c in commands:
            pipe.execute_command(*c.args)
        return list(pipe.execute(raise_on_error=False))

    def _pipeline(self, calls: Sequence[ScriptCall[Any]], *, by_source: bool = False) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for c in calls:
            # As a raw command: redis-py's cluster pipeline refuses its evalsha() method but
            # routes EVALSHA (and EVAL) by its keys (each call's keys share one slot).
            if by_source:
                pipe.execute_command(*eval_args(c))
            else:
                pipe.execute_command(
                    "EVALSHA", self._scripts[c.script].sha, len(c.keys), *c.keys, *c.args
                )
        return list(pipe.execute(raise_on_error=False))
