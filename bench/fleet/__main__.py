"""``python -m bench.fleet``: runs :mod:`bench.fleet.compare`."""

from bench.fleet.compare import main

if __name__ == "__main__":
    main()
