"""``cancel_and_wait``: a task that lost a cancellation is cancelled again; one that will not
end is handed back, not waited on for good."""

from __future__ import annotations

import asyncio

from backfill.cancelling import cancel_and_wait


async def _loses(times: list[int], cancelled: list[int]) -> None:
    """A loop whose first ``times[0]`` cancellations are lost (3.11's ``wait_for`` race)."""
    while True:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(1)
            if len(cancelled) > times[0]:
                raise


def test_a_lost_cancellation_is_sent_again_until_the_task_ends() -> None:
    async def main() -> tuple[set[asyncio.Task[None]], int, bool]:
        seen: list[int] = []
        task = asyncio.create_task(_loses([2], seen))
        await asyncio.sleep(0)
        stuck = await cancel_and_wait([task], retry_s=0.01)
        return stuck, len(seen), task.cancelled()

    stuck, seen, cancelled = asyncio.run(main())
    assert stuck == set()
    assert seen == 3
    assert cancelled


def test_a_task_that_never_ends_is_handed_back_after_the_patience() -> None:
    async def main() -> tuple[bool, bool]:
        seen: list[int] = []
        lost = [10**9]
        task = asyncio.create_task(_loses(lost, seen))
        await asyncio.sleep(0)
        stuck = await cancel_and_wait([task], retry_s=0.01, patience_s=0.05)
        handed_back = stuck == {task}
        lost[0] = 0  # now it obeys: ended, so the loop can close
        task.cancel()
        await asyncio.wait({task})
        return handed_back, len(seen) >= 2

    handed_back, retried = asyncio.run(main())
    assert handed_back
    assert retried


def test_a_failed_task_s_fault_is_left_to_the_caller_and_not_logged_as_unretrieved() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    async def main() -> asyncio.Task[None]:
        task = asyncio.create_task(fails())
        await asyncio.sleep(0)
        assert await cancel_and_wait([task]) == set()
        return task

    task = asyncio.run(main())
    assert isinstance(task.exception(), ValueError)
