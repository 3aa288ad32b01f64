"""Backfill core: settings, states, the domain model, the repository, the KV-token ledger,
the admission policy and the capacity model. Imports no FastAPI, Celery or vLLM."""

__version__ = "0.1.0"
