"""``python -m bench.churn``: runs :mod:`bench.store.churn`."""

from bench.store.churn import main

if __name__ == "__main__":
    main()
