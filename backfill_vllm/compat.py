"""The vLLM versions this scheduler is tested with, and the check that refuses the others.

The scheduler subclasses vLLM's ``Scheduler`` and leans on its internals (the request queues,
``_preempt_request``, the per-request token hook it caps batch through), which change between
releases without notice. On a version it was not tested with it refuses to load, in one line,
rather than schedule wrongly. ``BACKFILL_ALLOW_UNTESTED_VLLM=1`` loads it anyway (for
trying a new release, not for production).
"""

from __future__ import annotations

import os

from backfill_vllm import __version__

SUPPORTED_VLLM = ("0.32.0", "0.33.0")
ALLOW_UNTESTED = "BACKFILL_ALLOW_UNTESTED_VLLM"


class UnsupportedVllmError(RuntimeError):
    """The engine runs a vLLM version this scheduler was not tested with."""


def release(version: str) -> str:
    """``0.32.0`` of ``0.32.0+cpu`` (a build's local label does not change the scheduler)."""
    return version.split("+", 1)[0]


def check_vllm_version(version: str, environ: dict[str, str] | None = None) -> None:
    env = os.environ if environ is None else environ
    if release(version) in SUPPORTED_VLLM or env.get(ALLOW_UNTESTED) == "1":
        return
    raise UnsupportedVllmError(
        f"backfill_vllm {__version__} supports vLLM {', '.join(SUPPORTED_VLLM)} only; this "
        f"engine runs vLLM {version}: install a supported vLLM, or drop --scheduler-cls"
    )
