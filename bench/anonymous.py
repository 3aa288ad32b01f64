"""``python -m bench.anonymous``: runs :mod:`bench.api.anonymous`."""

from bench.api.anonymous import main

if __name__ == "__main__":
    main()
