"""``python -m bench.claim``: runs :mod:`bench.store.claim`."""

from bench.store.claim import main

if __name__ == "__main__":
    main()
