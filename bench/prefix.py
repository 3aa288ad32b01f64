"""``python -m bench.prefix``: runs :mod:`bench.throughput.prefix`."""

from bench.throughput.prefix import main

if __name__ == "__main__":
    main()
