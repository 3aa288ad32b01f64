"""What a worker whose dispatcher overran its stop logs: each task of its loop with its chain
of awaits, outermost first, down to what it waits on."""

from __future__ import annotations

import asyncio

from worker.node import _task_line


async def _inner(hold: asyncio.Event) -> None:
    await hold.wait()


async def _outer(hold: asyncio.Event) -> None:
    await _inner(hold)


def test_a_tasks_line_names_it_and_every_await_down_to_the_future() -> None:
    async def main() -> str:
        hold = asyncio.Event()
        task = asyncio.create_task(_outer(hold), name="observe")
        await asyncio.sleep(0)
        line = _task_line(task)
        hold.set()
        await task
        return line

    line = asyncio.run(main())
    assert line.startswith("task observe: test_stop_report.py:")
    parts = line.split(": ", 1)[1].split(" > ")
    assert [p.split(" ")[-1] for p in parts[:3]] == ["_outer", "_inner", "wait"]
