"""``python -m bench.ingest``: runs :mod:`bench.store.ingest`."""

from bench.store.ingest import main

if __name__ == "__main__":
    main()
