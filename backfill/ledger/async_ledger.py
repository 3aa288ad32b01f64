"""The ledger over ``redis.asyncio``, one server or a Redis Cluster (the asyncio worker and
gateway): the same operations as :class:`~backfill.ledger.Ledger` (bound once, in
:mod:`backfill.ledger.binding`), the same scripts and values, each step awaited."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import redis.asyncio.cluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from backfill.errors import LedgerError, LedgerUnavailable
from backfill.ledger.binding import LedgerBinding
from backfill.ledger.listeners import AsyncChannelListener
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
from backfill.redis_client import AsyncRedis, connect_async

T = TypeVar("T")


class AsyncLedger(LedgerBinding[AsyncRedis, AsyncScript]):
    """The ledger over ``redis.asyncio``."""

    @classmethod
    def _connect(cls, url: str) -> AsyncRedis:
        return connect_async(url)

    def _register(self, client: AsyncRedis, source: str) -> AsyncScript:
        return client.register_script(source)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def listen_preemptions(self, node: str) -> AsyncChannelListener:
        """A subscription to ``node``'s preempt channel, already subscribed when returned."""
        return await self._listen(self.keys.preempt_channel(node))

    async def listen_claimable(self) -> AsyncChannelListener:
        """A subscription to the channel of newly claimable work (``backfill.work_bell``),
        already subscribed when returned: its messages are models."""
        return await self._listen(self.keys.claimable_channel())

    async def _listen(self, channel: str) -> AsyncChannelListener:
        try:
            if isinstance(self._client, redis.asyncio.cluster.RedisCluster):
                # Its pub/sub picks a node from the slot map, which a fresh client has not
                # loaded yet (the first command would): load it first.
                await self._client.initialize()
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            await pubsub.subscribe(channel)
        except REDIS_ERRORS as exc:
            raise translate(exc) from exc
        return AsyncChannelListener(pubsub)

    # -- carrying plans out

    async def drive(self, plan: Plan[T]) -> T:
        """Run ``plan``'s steps in turn, awaiting each; returns what it returns. A step's
        ledger error is raised inside the plan, which may undo what it did before."""
        try:
            step = next(plan)
            while True:
                try:
                    reply = await self._carry_out(step)
                except (LedgerError, LedgerUnavailable) as exc:
                    step = plan.throw(exc)
                else:
                    step = plan.send(reply)
        except StopIteration as done:
            result: T = done.value
            return result

    async def _carry_out(self, step: Step) -> Any:
        try:
            if isinstance(step, ScriptCall):
                reply = await self._script_call(step)
            elif isinstance(step, Command):
                reply = await self._client.execute_command(*step.args)
            elif isinstance(step, Commands):
                reply = await self._pipeline_commands(step.commands)
            elif isinstance(step, Scan):
                reply = [k async for k in self._client.scan_iter(match=step.pattern, count=1000)]
            else:
                reply = await self._pipeline_retrying(step.calls)
        except REDIS_ERRORS as exc:
            raise translate(exc) from exc
        return step.parse(reply)

    async def _script_call(self, call: ScriptCall[Any]) -> Any:
        try:
            return await self._scripts[call.script](keys=call.keys, args=call.args)
        except NoScriptError:
            # redis-py loaded the script again and still found it missing: after a failover
            # its view of the cluster may load it elsewhere (a promoted replica has no
            # scripts). EVAL goes where the keys are and caches the script there.
            return await self._client.execute_command(*eval_args(call))

    async def _pipeline_retrying(self, calls: Sequence[ScriptCall[Any]]) -> list[Any]:
        if not calls:
            return []
        replies = await self._pipeline(calls)
        missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if missing:
            # NOSCRIPT refuses a call before it runs, so running those again is safe; as EVAL,
            # which goes where the keys are and caches the script there (SCRIPT LOAD after a
            # failover may go by a stale view of the cluster, and a promoted replica has no
            # scripts of its own).
            again = await self._pipeline([calls[i] for i in missing], by_source=True)
            for i, r in zip(missing, again, strict=True):
                replies[i] = r
        return replies

    async def _pipeline_commands(self, commands: Sequence[Command[Any]]) -> list[Any]:
        if not commands:
            return []
        pipe = self._client.pipeline(transaction=False)
        for c in commands:
            pipe.execute_command(*c.args)
        return list(await pipe.execute(raise_on_error=False))

    async def _pipeline(
        self, calls: Sequence[ScriptCall[Any]], *, by_source: bool = False
    ) -> list[Any]:
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
        return list(await pipe.execute(raise_on_error=False))
