"""Interactive protection: interactive time to first token while batch shares the engine, Backfill
against vLLM's priority and fcfs scheduling (``python -m bench.protection``); what Backfill costs
interactive with no batch at all (``python -m bench.interactive_overhead``); the simulated
trade-off curve (``python -m bench.work_budget_tradeoff``)."""
