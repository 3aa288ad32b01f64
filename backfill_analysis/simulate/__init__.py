"""A discrete-event simulator of a continuous-batching engine with a paged KV pool, for
comparing admission policies on interactive traces plus batch backlogs.

Standard library only (matplotlib only when plots are drawn); the Backfill policies run
the real :mod:`backfill.policy`. Modules: ``trace`` (loader), ``workload`` (batch jobs),
``costmodel`` (step time), ``engine`` (the engine), ``prefix_cache`` (shared prompt prefixes:
the engine's prefix cache and the ledger's once-per-node hold), ``stepsched`` (the settings
and sizing of Backfill's step-shaping engine scheduler), ``policies``, ``run`` (one run),
``compare`` (all policies, baselines, sweeps), ``report`` and ``plots``, ``closedloop`` (the
calibration check's client), ``scenario`` (named setups).
"""
