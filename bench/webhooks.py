"""``python -m bench.webhooks``: runs :mod:`bench.api.webhooks`."""

from bench.api.webhooks import main

if __name__ == "__main__":
    main()
