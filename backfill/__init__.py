"""Backfill core: the domain and its rules. Settings, states, the domain model, the store
(the only SQL), the KV-token ledger, the admission policy, the capacity model, the work
budget, interactive admission (``gateway/``) and the engine protocol with its vLLM HTTP client
(``engine/``). Imports no web framework, Celery, vLLM, worker, API, command line or analysis
tool (``tests/unit/test_import_boundaries.py``)."""
