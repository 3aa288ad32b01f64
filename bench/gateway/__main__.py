"""``python -m bench.gateway``: runs :mod:`bench.gateway.compare`."""

from bench.gateway.compare import main

if __name__ == "__main__":
    main()
