"""``python -m bench.protection``: runs :mod:`bench.protection.compare`."""

from bench.protection.compare import main

if __name__ == "__main__":
    main()
