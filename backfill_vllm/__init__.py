"""Backfill's step scheduler for vLLM's V1 engine (``--scheduler-cls
backfill_vllm.scheduler.BackfillScheduler``).

Installed into the engine's environment (``pip install ./backfill_vllm``), not Backfill's:
the scheduler subclasses vLLM's own, so everything it does not change stays vLLM's. This
package's top level and its pure modules (``settings``, ``stepmodel``, ``policy``,
``metrics``) import no vLLM; only ``scheduler`` and ``compat``'s check do.
"""

__version__ = "0.1.0"
