"""``python -m bench.fairness``: runs :mod:`bench.fairness.compare`."""

from bench.fairness.compare import main

if __name__ == "__main__":
    main()
