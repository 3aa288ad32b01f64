"""``--watch``: what the CLI fetches, shown again every interval until it has a terminal status.

On a terminal the view is redrawn in place. Anywhere else (a pipe, a log, CI) there is nothing
to redraw in, and rich's live view prints only when it stops, which a watch without a terminal
status (``capacity``) never does: so each reading that differs from the one before is printed
as it comes, one after another.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

from rich.console import Console, RenderableType
from rich.live import Live


def watch(
    console: Console,
    fetch: Callable[[], dict[str, Any]],
    render: Callable[[dict[str, Any]], RenderableType],
    interval: float,
    terminal: Collection[str],
) -> None:
    """Show ``render`` of what ``fetch`` answers every ``interval`` seconds until its status is
    one of ``terminal`` (or Ctrl-C)."""
    seen = fetch()
    if not console.is_terminal:
        console.print(render(seen))
        while seen.get("status") not in terminal:
            time.sleep(interval)
            last, seen = seen, fetch()
            if seen != last:
                console.print(render(seen))
        return
    with Live(render(seen), console=console, refresh_per_second=4, transient=False) as live:
        while seen.get("status") not in terminal:
            time.sleep(interval)
            seen = fetch()
            live.update(render(seen))
