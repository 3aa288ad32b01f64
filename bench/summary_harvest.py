"""``python -m bench.summary_harvest``: runs :mod:`bench.store.summary_harvest`."""

from bench.store.summary_harvest import main

if __name__ == "__main__":
    main()
