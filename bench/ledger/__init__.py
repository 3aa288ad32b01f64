"""The ledger (Redis) against raw scripts: reserve and release pairs (``python -m bench.ledger``),
and how fast a preempted batch lease's worker hears of it (``python -m bench.preempt_signal``)."""
