"""``python -m bench.submit``: runs :mod:`bench.api.submit`."""

from bench.api.submit import main

if __name__ == "__main__":
    main()
