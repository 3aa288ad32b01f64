"""The ``backfill`` command line and the process wiring: serve the API, run a worker or beat,
start a development stack, manage tenants, talk to a running API, plan capacity.

The one package allowed to import every layer (``backfill``, ``queue_api``, ``worker``,
``backfill_analysis``) and the dev kit (``devkit``); it does so inside its commands, so each command
loads only what it runs (``backfill worker`` and ``backfill api`` never load ``devkit``).
"""
