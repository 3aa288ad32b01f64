"""``python -m bench.interactive_overhead``: runs :mod:`bench.protection.overhead`."""

from bench.protection.overhead import main

if __name__ == "__main__":
    main()
