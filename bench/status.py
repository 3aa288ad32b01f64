"""``python -m bench.status``: runs :mod:`bench.api.status`."""

from bench.api.status import main

if __name__ == "__main__":
    main()
