"""``python -m bench.ingest_queue``: runs :mod:`bench.store.ingest_queue`."""

from bench.store.ingest_queue import main

if __name__ == "__main__":
    main()
