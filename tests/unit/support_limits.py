"""The batch input limits the unit tests of batch lines start from; a module changes what
it tests with ``dataclasses.replace``."""

from __future__ import annotations

from backfill.batch_input import InputLimits

BATCH_LIMITS = InputLimits(10_000_000, 100_000, 1000, 4096, 16)
"""10 MB a file, 100 kB a line, 1,000 lines, 4,096 tokens a sequence, 16 bytes a token (and
the defaults of the rest)."""
