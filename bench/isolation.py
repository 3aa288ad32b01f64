"""``python -m bench.isolation``: runs :mod:`bench.api.isolation`."""

from bench.api.isolation import main

if __name__ == "__main__":
    main()
