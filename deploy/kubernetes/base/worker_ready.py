"""Readiness of the worker beside an engine, for its pod's probe: ready while the node's
dispatcher publishes its work budget in Redis, which it does only once it has reached its
engine, registered the node and entered its loop, and keeps doing while that loop runs.

The worker serves no HTTP of its own, and its Celery process lives on when the dispatcher
thread beside it waits for an engine or has stopped; this reads what the dispatcher itself
writes, through Backfill's own code (``backfill.work_signals.read_budget``), so the key names
and the freshness rule stay the worker's. The node is the pod's name (the worker's ``--node``).
"""

from __future__ import annotations

import os
import sys

from backfill.config import Settings
from backfill.keys import LedgerKeys
from backfill.redis_client import connect
from backfill.work_signals import read_budget


def main() -> int:
    node = os.environ["POD_NAME"]
    settings = Settings()
    client = connect(settings.redis_url)
    try:
        budget = read_budget(client, LedgerKeys(settings.redis_namespace), node)
    finally:
        client.close()
    if budget is None:
        print(f"node {node}: its dispatcher publishes no work budget (not running)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
