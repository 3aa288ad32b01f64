"""``python -m backfill_cli``: the ``backfill`` command, for subprocesses of this interpreter."""

from backfill_cli.app import main

main()
