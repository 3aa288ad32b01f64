"""``python -m bench.throughput``: runs :mod:`bench.throughput.compare`."""

from bench.throughput.compare import main

if __name__ == "__main__":
    main()
