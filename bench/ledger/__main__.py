"""``python -m bench.ledger``: runs :mod:`bench.ledger.compare`."""

from bench.ledger.compare import main

if __name__ == "__main__":
    main()
