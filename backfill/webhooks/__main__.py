"""``python -m backfill.webhooks``: the webhook sender alone, until SIGTERM or Ctrl-C.

(``backfill beat`` and ``backfill worker --beat`` run one on a thread already; this is for a
deployment that wants it apart, or more than one.)
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

from sqlalchemy import create_engine

from backfill import logs
from backfill.config import get_settings
from backfill.webhooks.delivery import Sender
from backfill.webhooks.sealing import SecretSeal
from backfill.webhooks.store import WebhookStore


def main() -> None:
    settings = get_settings()
    logs.configure(settings.log_level, settings.log_format, root=True)
    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    engine = create_engine(settings.database_url, pool_size=4, max_overflow=4)
    sender = Sender(WebhookStore(engine, SecretSeal(settings.webhooks_seal_keys)), settings)
    try:
        sender.run(stop)
    finally:
        sender.close()
        engine.dispose()


if __name__ == "__main__":
    main()
