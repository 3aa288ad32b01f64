"""``python -m bench.preempt_signal``: runs :mod:`bench.ledger.preempt_signal`."""

from bench.ledger.preempt_signal import main

if __name__ == "__main__":
    main()
