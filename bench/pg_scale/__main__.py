"""``python -m bench.pg_scale``: runs :mod:`bench.pg_scale.compare`."""

from bench.pg_scale.compare import main

if __name__ == "__main__":
    main()
