"""A part of the node dispatcher works alone over a bare ``DispatcherState``: the result
writer, given only the state (no dispatcher, no services), commits what an attempt handed
it, counts it, forgets the attempt and only then gives its lease back."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import SimpleNamespace
from typing import cast

from backfill.dispatch import DispatchConfig, RunPlan
from backfill.engine.protocol import Engine
from backfill.ledger import BatchLedger, Lease
from backfill.policy import ServiceClass
from backfill.states import ItemState
from backfill.store import AttemptStore, Finish
from tests.unit.dispatch_builders import claimed
from worker.dispatch_results import ResultWriter
from worker.dispatch_state import DispatcherState, Finished, Flight


class Store:
    """The items role: applies every result but those of ``stale`` items; records what it
    was given."""

    def __init__(self, stale: frozenset[int] = frozenset()) -> None:
        self.stale = stale
        self.finished: list[Finish] = []

    def finish(self, batch: Sequence[Finish]) -> list[int]:
        self.finished.extend(batch)
        return [f.item_id for f in batch if f.item_id not in self.stale]


class Slack:
    """Records the leases given back, and what the store had written by then."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.released: list[tuple[str, int]] = []

    async def release_many(self, leases: Sequence[Lease]) -> None:
        self.released.extend((lease.lease_id, len(self.store.finished)) for lease in leases)


def _state(store: Store, slack: Slack) -> DispatcherState:
    return DispatcherState(
        DispatchConfig(node="n1", result_flush_s=0.0),
        cast(Engine, None),  # the writer never talks to the engine
        cast(AttemptStore, SimpleNamespace(items=store)),
        cast(BatchLedger, slack),
        model="m",
        block_size=16,
        max_sequence_tokens=1024,
    )


def _held(state: DispatcherState, item_id: int) -> Finished:
    item = claimed(item_id)
    lease = Lease(f"ls_{item_id}", "n1", ServiceClass.BATCH, 64, 1, 0, 0)
    flight = Flight(item, lease, item.endpoint, RunPlan({}, 0), generated=5)
    state.flights[item_id] = flight
    state.leases[lease.lease_id] = lease
    finish = Finish(item_id, item.attempt, 1, ItemState.SUCCEEDED, result="{}", output_tokens=5)
    return Finished(finish, flight)


def test_the_result_writer_commits_then_releases_over_a_bare_state() -> None:
    store = Store(stale=frozenset({2}))
    slack = Slack(store)
    state = _state(store, slack)
    writer = ResultWriter(state)

    async def write() -> None:
        task = asyncio.create_task(writer.write_results())
        await writer.put(_held(state, 1))
        await writer.put(_held(state, 2))
        await writer.put(None)
        await task

    asyncio.run(write())
    assert [f.item_id for f in store.finished] == [1, 2]
    # Both leases back, each only once its result was written.
    assert slack.released == [("ls_1", 2), ("ls_2", 2)]
    assert (state.stats.succeeded, state.stats.output_tokens, state.stats.stale_results) == (
        1,
        5,
        1,
    )
    assert state.flights == {}
    assert state.leases == {}


def test_work_rung_while_the_claim_loop_is_not_asleep_cuts_its_next_sleep() -> None:
    """A ring can come while a claim is under way that could not see the new job yet: the
    sleep after it returns at once (red before: the ring's wake was cleared by that sleep,
    and the job waited out the idle poll). One ring cuts one sleep, not every one after."""

    async def main() -> tuple[float, float]:
        store = Store()
        state = _state(store, Slack(store))
        state.work_claimable()  # while the loop claims
        started = asyncio.get_running_loop().time()
        await state.sleep(5.0)
        first = asyncio.get_running_loop().time() - started
        started = asyncio.get_running_loop().time()
        await state.sleep(0.2)
        return first, asyncio.get_running_loop().time() - started

    first, second = asyncio.run(main())
    assert first < 1.0, "the sleep after a ring was not cut"
    assert second >= 0.15, "a ring cut more than one sleep"


def test_any_wake_while_the_claim_loop_is_not_asleep_cuts_its_next_sleep() -> None:
    """A prefix pass records a page (or a lease is released) while a claim is under way that
    found the page's items still held: the sleep after that claim returns at once (red
    before: the sleep cleared the wake, and the page's items waited out the idle poll; CI's
    loaded run of ``test_a_nodes_claim_loop_takes_a_recorded_page_...`` caught it)."""

    async def main() -> float:
        store = Store()
        state = _state(store, Slack(store))
        state.room.set()  # a page recorded while the loop claims
        started = asyncio.get_running_loop().time()
        await state.sleep(5.0)
        return asyncio.get_running_loop().time() - started

    assert asyncio.run(main()) < 1.0, "a wake during the claim was lost by the sleep after it"
