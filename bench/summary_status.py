"""``python -m bench.summary_status``: runs :mod:`bench.store.summary_status`."""

from bench.store.summary_status import main

if __name__ == "__main__":
    main()
