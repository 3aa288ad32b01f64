"""``python -m bench.retention``: runs :mod:`bench.store.retention`."""

from bench.store.retention import main

if __name__ == "__main__":
    main()
